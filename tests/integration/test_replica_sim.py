"""Replica simulator over real HTTP and real ZeroMQ → a real indexer (memory index)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import click
import httpx
import pytest

from kvindex.clients.cli.main import replica_sim as replica_sim_command
from kvindex.clients.fake_vllm import replica as replica_module
from kvindex.clients.fake_vllm.replica import (
    LOOPBACK_EVENTS,
    ReplicaSim,
    ReplicaSimSettings,
)
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.domain.keys import block_keys
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.ingest.wire import Encoding
from tests.integration.harness import Indexer, running_indexer, settings_for, wait_until, warm_up

MODEL = "sim-model"
STREAM = StreamId("r1", 0)
SHARED = " ".join(f"s{i}" for i in range(40))  # 2 full blocks of 16 + 8 words


@contextmanager
def sim_and_indexer(
    encoding: Encoding, capacity_blocks: int = 64
) -> Iterator[tuple[ReplicaSim, Indexer, httpx.Client]]:
    """A simulator (HTTP on a free loopback port, PUB + ROUTER bound on free loopback
    ports) and an indexer subscribed to it in connect mode with replay; all stopped after."""
    settings = ReplicaSimSettings(
        id="r1",
        model=MODEL,
        capacity_blocks=capacity_blocks,
        events="tcp://127.0.0.1:*",
        replay="tcp://127.0.0.1:*",
        port=0,
        encoding=encoding,
        speed=1000.0,
        seed=0,
    )
    with ReplicaSim(settings) as sim:
        assert sim.publisher is not None
        spec = ReplicaSpec(
            id="r1", model=MODEL, events=sim.events_endpoint, replay=sim.replay_endpoint
        )
        with (
            running_indexer(settings_for(spec), MemoryIndex()) as ix,
            httpx.Client(base_url=sim.base_url, timeout=10) as http,
        ):
            warm_up(ix, sim.publisher, STREAM)
            yield sim, ix, http


def complete(http: httpx.Client, prompt: str, max_tokens: int = 4) -> int:
    """POST /v1/completions; the cached prompt tokens it reports."""
    response = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["kvsim"]["cached_tokens"] == body["usage"]["prompt_tokens_details"]["cached_tokens"]
    cached: int = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def matched(ix: Indexer, http: httpx.Client, prompt: str) -> int:
    """Blocks of ``prompt`` the index holds for r1, keys computed from /tokenize's tokens."""
    response = http.post("/tokenize", json={"model": MODEL, "prompt": prompt})
    assert response.status_code == 200, response.text
    tokens = response.json()["tokens"]
    keys = block_keys(MODEL, tokens, 16)
    return ix.index.longest_prefix(keys, [STREAM])[STREAM].num_blocks


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_shared_prefix_hits_and_the_index_predicts_them(encoding: Encoding) -> None:
    with sim_and_indexer(encoding) as (sim, ix, http):
        first = SHARED + " a1 a2 a3"
        second = SHARED + " b1 b2 b3 b4 b5 b6 b7 b8 b9 b10"
        assert complete(http, first) == 0
        wait_until(lambda: matched(ix, http, second) == 2, what="first request's blocks indexed")
        cached = complete(http, second)
        assert cached == 2 * 16  # exactly what the index predicted before the request
        wait_until(lambda: matched(ix, http, second) == 3, what="second request's blocks")
        assert sim.engine is not None
        cache = sim.engine.cache
        wait_until(
            lambda: ix.index.stats(STREAM).num_blocks == cache.num_cached_blocks,
            what="index holds exactly the replica's cached blocks",
        )
        metrics = http.get("/metrics").text
        assert f'vllm:prefix_cache_hits_total{{model_name="{MODEL}"}} 32.0' in metrics
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_evictions_remove_blocks_from_the_index(encoding: Encoding) -> None:
    with sim_and_indexer(encoding, capacity_blocks=8) as (sim, ix, http):
        first = SHARED + " a1"
        complete(http, first)  # 41 + 4 tokens: 2 cached blocks
        wait_until(lambda: matched(ix, http, first) == 2, what="first request indexed")
        for i in range(4):  # 4 blocks each, 3 of them cached: pushes the first out (LRU)
            complete(http, " ".join(f"x{i}-{j}" for j in range(48)))
        assert sim.engine is not None
        cache = sim.engine.cache
        assert cache.num_cached_blocks <= 8
        wait_until(lambda: matched(ix, http, first) == 0, what="evicted blocks removed")
        wait_until(
            lambda: ix.index.stats(STREAM).num_blocks == cache.num_cached_blocks,
            what="index holds exactly the replica's cached blocks",
        )
        assert complete(http, first) == 0  # the replica agrees: nothing left to hit


def test_by_default_the_sim_binds_its_sockets_on_loopback_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    context = click.Context(replica_sim_command)
    defaults = {p.name: p.get_default(context) for p in replica_sim_command.params}
    assert not isinstance(defaults["events"], str)  # none given: LOOPBACK_EVENTS, bound
    assert defaults["replay"] == ReplicaSimSettings().replay == "tcp://127.0.0.1:5558"
    assert LOOPBACK_EVENTS == "tcp://127.0.0.1:5557"
    # The default events endpoint is bound (not connected): on a free port here.
    monkeypatch.setattr(replica_module, "LOOPBACK_EVENTS", "tcp://127.0.0.1:*")
    with ReplicaSim(ReplicaSimSettings(replay=None, port=0)) as sim:
        host, _, port = sim.events_endpoint.rpartition(":")
        assert (host, port.isdigit()) == ("tcp://127.0.0.1", True)
