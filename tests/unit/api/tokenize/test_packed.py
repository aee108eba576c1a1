"""Token ids packed as u32 bytes: what the tokenizer cache keeps and hands out, and what the
scorer keys when its tokenizer packs them (the same keys as from a list)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from kvindex.api.config.settings import ApiSettings
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.schemas import ScoreRequest, ScoreResponse
from kvindex.api.score import Scorer
from kvindex.api.tokenize.cache import CachingTokenizer
from kvindex.api.tokenize.chat_template import ChatTemplate
from kvindex.api.tokenize.local import LocalTokenizer
from kvindex.api.tokenize.protocol import (
    NO_OPTIONS,
    ChatOptions,
    Tokenizer,
    as_packed,
    pack_ids,
    unpack_ids,
)
from kvindex.api.tokenize.replica import ReplicaTokenizer
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.domain.keys import block_keys
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import OpKind
from tests.support.tokenizer_kinds import KINDS

TOKENS = [*range(1, 60), 2**32 - 1]
MESSAGES = [{"role": "user", "content": "hello"}]


class ListTokenizer:
    """Answers every prompt and conversation with TOKENS, as a list only."""

    def __init__(self) -> None:
        self.num_calls = 0

    async def encode_prompt(self, prompt: str) -> list[int]:
        self.num_calls += 1
        return list(TOKENS)

    async def encode_messages(
        self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS
    ) -> list[int]:
        self.num_calls += 1
        return list(TOKENS)


def test_pack_and_unpack_are_inverse() -> None:
    packed = pack_ids(TOKENS)
    assert len(packed) == 4 * len(TOKENS) and packed[:4] == (1).to_bytes(4, "little")
    assert unpack_ids(packed) == TOKENS


def test_the_cache_keeps_packed_ids_and_hands_the_same_bytes_again() -> None:
    inner = ListTokenizer()
    cache = CachingTokenizer(inner)

    async def main() -> tuple[bytes, bytes, list[int]]:
        first = await cache.packed_messages(MESSAGES)
        again = await cache.packed_messages(MESSAGES)
        return first, again, await cache.encode_messages(MESSAGES)

    first, again, listed = asyncio.run(main())
    assert first == pack_ids(TOKENS) and again is first  # a hit copies nothing
    assert listed == TOKENS and inner.num_calls == 1
    assert asyncio.run(cache.packed_prompt("p")) == pack_ids(TOKENS)


def test_only_tokenizers_with_packed_methods_count_as_packed() -> None:
    replica = ReplicaTokenizer(httpx.AsyncClient(), "http://127.0.0.1:1", "m")
    assert as_packed(replica) is None and as_packed(ListTokenizer()) is None
    cache = CachingTokenizer(replica)
    assert as_packed(cache) is cache


def _answer(tokenizer: Tokenizer) -> ScoreResponse:
    registry = Registry((ReplicaSpec("a", "m"), ReplicaSpec("b", "m")), clock=lambda: 100.0)
    index = MemoryIndex()
    keys = block_keys("m", TOKENS, 16)
    index.apply(StreamId("a"), 0, 100.0, [(OpKind.STORE, Tier.GPU, 0, k) for k in keys[:2]])
    registry.record(StreamId("a"), StreamReport(last_seq=0, last_event_ts=99.5))
    scorer = Scorer(
        ApiSettings(seed=1),
        index,
        registry,
        MemoryLoadStore(),
        tokenizers=lambda _: tokenizer,
        blocking_store=False,
        clock=lambda: 100.0,
    )
    return asyncio.run(scorer.score(ScoreRequest(model="m", messages=MESSAGES)))


def test_the_scorer_keys_packed_ids_as_it_keys_the_list() -> None:
    packed, listed = _answer(CachingTokenizer(ListTokenizer())), _answer(ListTokenizer())
    assert packed == listed
    assert packed.best == "a" and packed.num_tokens == len(TOKENS)


def test_a_local_miss_on_the_loop_is_answered_without_a_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tok, template, special_tokens = KINDS["byte_level_bpe"]()
    template_ = ChatTemplate(template, special_tokens=special_tokens)
    local = LocalTokenizer(tok, template_, fast=False)  # the fast path never needs a thread
    cache = CachingTokenizer(local)
    expected = asyncio.run(local.packed_messages(MESSAGES))
    tasks: list[object] = []
    create_task = asyncio.create_task

    def counted(coro: Any) -> Any:
        tasks.append(coro)
        return create_task(coro)

    monkeypatch.setattr(asyncio, "create_task", counted)

    async def both() -> tuple[bytes, bytes]:
        return await cache.packed_messages(MESSAGES), await cache.packed_messages(MESSAGES)

    assert asyncio.run(both()) == (expected, expected)
    assert (cache.num_misses, cache.num_hits, len(tasks)) == (1, 1, 0)
    local.inline_max_chars = 0  # every text now goes to a thread: the task path
    long = [{"role": "user", "content": "hello there"}]
    assert asyncio.run(cache.packed_messages(long)) == asyncio.run(local.packed_messages(long))
    assert (cache.num_misses, len(tasks)) == (2, 1)
