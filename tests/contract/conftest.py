"""The contract suite's fixtures: every test in ``tests/contract`` runs on each backend.

Backends: ``memory`` (:class:`MemoryIndex`), ``fakeredis`` (:class:`RedisIndex` over an
in-process fake whose Lua runs in lupa) and ``redis`` (:class:`RedisIndex` over the private
redis-server of ``tests/conftest.py``). None is ever skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import fakeredis
import pytest
import redis

from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import BlockIndex
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.redis_schema import Schema

BACKENDS = ("memory", "fakeredis", "redis")

IndexFactory = Callable[[], BlockIndex]
"""Returns a fresh, empty index; on a shared server each call first wipes the server."""


def _memory_factory() -> IndexFactory:
    return MemoryIndex


def _fakeredis_factory() -> IndexFactory:
    def make() -> BlockIndex:
        # A FakeRedis made without host/port gets a server of its own: nothing is shared.
        return RedisIndex(fakeredis.FakeRedis(), Schema("test"))

    return make


def _redis_factory(client: redis.Redis) -> IndexFactory:
    def make() -> BlockIndex:
        client.flushall()
        # A new RedisIndex too: the old one remembers which streams it registered.
        return RedisIndex(client, Schema("test"))

    return make


@pytest.fixture(params=BACKENDS)
def make_index(request: pytest.FixtureRequest) -> Iterator[IndexFactory]:
    """A factory of fresh indexes on one backend (for tests that reset between examples)."""
    backend: str = request.param
    if backend == "memory":
        factory = _memory_factory()
    elif backend == "fakeredis":
        factory = _fakeredis_factory()
    else:
        client: redis.Redis = request.getfixturevalue("redis_client")
        factory = _redis_factory(client)
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
