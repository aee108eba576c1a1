"""A Redis that lost its data (FLUSHALL, restarted empty) is refilled at once; one that kept
it (restarted with AOF) costs nothing. Publisher (real ZeroMQ, replay) → indexer → a
redis-server of each test's own, so that it can be flushed and restarted."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from kvindex.clients.fake_vllm.publisher import EventPublisher
from kvindex.indexer.domain.events import BlockStored, StreamId, Tier
from kvindex.indexer.domain.keys import block_keys
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.redis.connection import connect
from kvindex.indexer.redis.schema import Schema
from tests.integration.harness import (
    MODEL,
    Indexer,
    publisher_at,
    replica_of,
    running_indexer,
    settings_for,
    wait_until,
    warm_up,
)
from tests.support.redis_server import RedisServer, free_port, running_redis

pytestmark = pytest.mark.redis_server

R1 = StreamId("r1", 0)
NUM_BLOCKS = 6
TOKENS = list(range(5000, 5000 + 16 * NUM_BLOCKS))
REFILL_BOUND_S = 3.0
"""A store loss is seen by the next maintenance tick (1 s), then one replay from 0 of a
local engine: well under this."""


def matched(index: RedisIndex) -> int:
    keys = block_keys(MODEL, TOKENS, 16)
    return index.longest_prefix(keys, [R1])[R1].num_blocks


def publish_chain(pub: EventPublisher) -> int:
    """Every block of TOKENS, one batch per block; returns the last seq."""
    seq = -1
    for i in range(NUM_BLOCKS):
        parent = None if i == 0 else 100 + i - 1
        tokens = TOKENS[i * 16 : (i + 1) * 16]
        seq = pub.publish([BlockStored((100 + i,), parent, tokens, 16, Tier.GPU)])
    return seq


@contextmanager
def indexed_chain(url: str) -> Iterator[tuple[Indexer, RedisIndex]]:
    """An indexer on ``url`` whose one replica has published the whole chain."""
    pub = publisher_at(None, None)
    index = RedisIndex(connect(url, socket_timeout_s=0.5), Schema("refill"))
    try:
        with running_indexer(settings_for(replica_of(pub)), index) as ix:
            warm_up(ix, pub, R1)
            wait_until(ix.applied(R1, publish_chain(pub)), what="chain applied")
            assert matched(index) == NUM_BLOCKS
            yield ix, index
    finally:
        pub.close()


def refilled_within(ix: Indexer, index: RedisIndex) -> float:
    """Seconds until the index holds the whole chain again (asserted within the bound)."""
    started = time.monotonic()
    wait_until(lambda: matched(index) == NUM_BLOCKS, REFILL_BOUND_S + 5, what="index refilled")
    took = time.monotonic() - started
    print(f"refilled {NUM_BLOCKS} blocks in {took:.2f} s (bound {REFILL_BOUND_S} s)")
    assert took < REFILL_BOUND_S
    assert ix.status(R1).health.num_store_refills == 1
    return took


def test_a_flushed_redis_is_refilled_from_the_replay_buffer() -> None:
    with running_redis() as server, indexed_chain(server.url) as (ix, index):
        server.client().flushall()
        assert matched(index) == 0
        refilled_within(ix, index)
        assert ix.status(R1).health.num_store_errors == 0  # no write failed: none was made


def test_a_redis_restarted_empty_is_refilled_without_any_event() -> None:
    with running_redis() as server, indexed_chain(server.url) as (ix, index):
        server.restart()
        refilled_within(ix, index)


@contextmanager
def aof_redis() -> Iterator[tuple[RedisServer, Callable[[], None]]]:
    """A redis-server that keeps its data across a restart (append-only file, fsync'd at
    each write), and what restarts it."""
    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is not installed"
    with tempfile.TemporaryDirectory(prefix="kvindex-aof-") as tmp:
        port = free_port()
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "yes", "--appendfsync", "always", "--dir", tmp]
        server = RedisServer(port, subprocess.Popen(args, stdout=subprocess.DEVNULL), Path(tmp))

        def restart() -> None:
            server.stop()  # SIGTERM: the file is complete
            server.process = subprocess.Popen(args, stdout=subprocess.DEVNULL)
            wait_until(lambda: _pings(server), what="redis-server ready")

        try:
            wait_until(lambda: _pings(server), what="redis-server ready")
            yield server, restart
        finally:
            server.stop()


def _pings(server: RedisServer) -> bool:
    client = server.client()
    try:
        return bool(client.ping())
    except redis.ConnectionError:  # not listening yet
        return False
    finally:
        client.close()


def test_a_redis_restarted_with_its_data_costs_nothing() -> None:
    with aof_redis() as (server, restart), indexed_chain(server.url) as (ix, index):
        before = ix.status(R1).health
        restart()
        time.sleep(2.5)  # two maintenance ticks look at the marker
        after = ix.status(R1).health
        assert after.num_store_refills == 0
        assert (after.num_replays, after.num_batches) == (before.num_replays, before.num_batches)
        assert matched(index) == NUM_BLOCKS
