"""Each ``--lie`` of a replica-sim, on its engine without sockets."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvindex.clients.fake_vllm.lies import LieError, LieKind, Lies, RecutPool, lie_of
from kvindex.clients.fake_vllm.replica import (
    Engine,
    ReplicaSimError,
    ReplicaSimSettings,
    SimRequest,
    handle_completion,
)
from kvindex.indexer.domain.events import BlockRemoved, BlockStored, Event

ROOT = 7


def _engine(*lies: str, capacity: int = 4) -> tuple[Engine, list[list[Event]], list[str]]:
    settings = ReplicaSimSettings(block_size=2, capacity_blocks=capacity, speed=1000.0, lies=lies)
    told = Lies(lies)
    batches: list[list[Event]] = []
    restarts: list[str] = []
    pool = told.pool(capacity, 2, ROOT)
    eng = Engine(settings, pool, batches.append, lies=told, on_restart=lambda: restarts.append("x"))
    return eng, batches, restarts


def _run(eng: Engine, prompt: list[int]) -> int:
    return asyncio.run(eng.run(SimRequest(prompt, 1))).cached_tokens


def test_lies_are_parsed_with_their_values_and_bad_ones_refused() -> None:
    assert lie_of("events-off-restart").value == 20
    assert lie_of("block-size=32").value == 32 and lie_of("tokenizer").value == 1
    for bad in (
        "nonsense",
        "block-size",
        "block-size=0",
        "drop-removals=2",
        "tokenizer=x",
        "tokenizer=²",
    ):
        with pytest.raises(LieError):
            lie_of(bad)
    with pytest.raises(ReplicaSimError, match="at most once"):
        ReplicaSimSettings(lies=("tokenizer", "tokenizer=2"))


def test_drop_removals_evicts_but_publishes_no_removal() -> None:
    eng, batches, _ = _engine("drop-removals")
    for first in range(1, 40, 4):  # 3 blocks a request in a pool of 4: evictions each time
        _run(eng, [first, first + 1, first + 2, first + 3, first + 4])
    events = [e for b in batches for e in b]
    assert eng.cache.num_evicted > 0
    assert not any(isinstance(e, BlockRemoved) for e in events)
    assert any(isinstance(e, BlockStored) for e in events)


def test_an_events_off_restart_empties_the_cache_and_publishes_nothing_after() -> None:
    eng, batches, restarts = _engine("events-off-restart=2", capacity=16)
    prompt = [1, 2, 3, 4, 5]
    assert (_run(eng, prompt), _run(eng, prompt)) == (0, 4)
    num_published = len(batches)
    assert restarts == ["x"]
    assert _run(eng, prompt) == 0  # the cache was emptied
    assert _run(eng, prompt) == 4  # and fills again, unpublished
    assert len(batches) == num_published and restarts == ["x"]


def test_block_size_cuts_the_events_in_other_blocks_the_cache_unchanged() -> None:
    eng, batches, _ = _engine("block-size=4", capacity=16)
    assert isinstance(eng.cache, RecutPool)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert (_run(eng, prompt), _run(eng, prompt)) == (0, 8)  # 2-token blocks, as configured
    stored = [e for b in batches for e in b if isinstance(e, BlockStored)]
    assert stored and {e.block_size for e in stored} == {4}
    assert all(len(e.token_ids) == 4 * len(e.block_hashes) for e in stored)
    eng.cache.check()


def test_the_tokenizer_lie_counts_more_prompt_tokens() -> None:
    eng, _, _ = _engine("tokenizer=2", capacity=16)
    assert LieKind.TOKENIZER in eng.lies
    body = json.dumps({"model": "demo-model", "prompt": "a b c", "max_tokens": 1}).encode()
    answer = json.loads(bytes(asyncio.run(handle_completion(eng, body)).body))
    assert answer["usage"]["prompt_tokens"] == 5
