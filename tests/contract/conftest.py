"""The contract suite's fixtures: every test in ``tests/contract`` runs on each backend.

Backends: ``memory`` (:class:`MemoryIndex` on its compiled tables when built),
``memory-python`` (on the Python oracle ``tests.oracles.tables.PyTables``), ``fakeredis``
(:class:`RedisIndex` over an in-process fake whose Lua runs in lupa), ``redis``
(:class:`RedisIndex` over the private redis-server of ``tests/conftest.py``) and ``cluster``
(over its private 3-master Redis Cluster); the index suite also runs on ``memory-python``
and on the memory index wrapped (``circuit``: :class:`CircuitIndex`, ``journaled``:
:class:`JournaledIndex`, ``timed``: the API's :class:`TimedIndex`), which must keep every
promise of what they wrap. None is ever
skipped. :func:`redis_store_client` gives the Redis-backed suites
(load, registry view) the same backends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import fakeredis
import pytest
from prometheus_client import CollectorRegistry, Histogram

from kvindex.api.http.metrics import TimedIndex
from kvindex.indexer.index.block_journal import BlockJournal, JournaledIndex
from kvindex.indexer.index.circuit import CircuitIndex, StoreCircuit
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import BlockIndex
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.redis.connection import RedisClient
from kvindex.indexer.redis.schema import Schema
from tests.oracles.tables import python_index

REDIS_BACKENDS = ("fakeredis", "redis", "cluster")
BACKENDS = ("memory", *REDIS_BACKENDS)
WRAPPED_BACKENDS = ("circuit", "journaled", "timed")
INDEX_BACKENDS = ("memory", "memory-python", *WRAPPED_BACKENDS, *REDIS_BACKENDS)
"""The index suite's: the memory index on its compiled tables, on the pure-Python ones, and
inside each index wrapper."""

IndexFactory = Callable[[], BlockIndex]
"""Returns a fresh, empty index; on a shared server each call first wipes the server."""


def _memory_factory(*, compiled: bool) -> IndexFactory:
    def make() -> BlockIndex:
        return MemoryIndex() if compiled else python_index()

    return make


def _wrapped_factory(wrapper: str) -> IndexFactory:
    def make() -> BlockIndex:
        if wrapper == "circuit":
            return CircuitIndex(MemoryIndex(), StoreCircuit(cooldown_s=1.0))
        if wrapper == "timed":
            timings = Histogram("lookup_seconds", "lookups", registry=CollectorRegistry())
            return TimedIndex(MemoryIndex(), timings)
        return JournaledIndex(MemoryIndex(), BlockJournal())

    return make


def _fakeredis_factory() -> IndexFactory:
    def make() -> BlockIndex:
        # A FakeRedis made without host/port gets a server of its own: nothing is shared.
        return RedisIndex(fakeredis.FakeRedis(), Schema("test"))

    return make


def redis_store_client(backend: str, request: pytest.FixtureRequest) -> RedisClient:
    """An empty Redis of one of :data:`REDIS_BACKENDS` (a real one flushed, not closed:
    its fixture closes it)."""
    if backend == "fakeredis":
        # A FakeRedis made without host/port gets a server of its own: nothing is shared.
        return fakeredis.FakeRedis()
    fixture = "redis_cluster_client" if backend == "cluster" else "redis_client"
    client: RedisClient = request.getfixturevalue(fixture)
    return client


def _redis_factory(client: RedisClient) -> IndexFactory:
    def make() -> BlockIndex:
        client.flushall()
        # A new RedisIndex too: the old one remembers which streams it registered.
        return RedisIndex(client, Schema("test"))

    return make


@pytest.fixture(params=INDEX_BACKENDS)
def make_index(request: pytest.FixtureRequest) -> Iterator[IndexFactory]:
    """A factory of fresh indexes on one backend (for tests that reset between examples)."""
    backend: str = request.param
    if backend in ("memory", "memory-python"):
        factory = _memory_factory(compiled=backend == "memory")
    elif backend in WRAPPED_BACKENDS:
        factory = _wrapped_factory(backend)
    elif backend == "fakeredis":
        factory = _fakeredis_factory()
    else:
        factory = _redis_factory(redis_store_client(backend, request))
    made: list[BlockIndex] = []

    def make() -> BlockIndex:
        index = factory()
        made.append(index)
        return index

    yield make
    for index in made:
        index.close()


@pytest.fixture
def index(make_index: IndexFactory) -> BlockIndex:
    """One empty index on the backend under test."""
    return make_index()
