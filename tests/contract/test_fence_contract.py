"""The batch fence of sharded indexers, on every Redis backend (fake, standalone, Cluster):
a writer whose lease token is not the stream's owner changes nothing, inside the script."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.index.protocol import FencedError, OpKind
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.redis.connection import RedisClient
from kvindex.indexer.redis.schema import META_OWNER, Schema
from tests.contract.conftest import REDIS_BACKENDS, redis_store_client

S = StreamId("r1", 3)
SCHEMA = Schema("test")


@pytest.fixture(params=REDIS_BACKENDS)
def client(request: pytest.FixtureRequest) -> Iterator[RedisClient]:
    store = redis_store_client(request.param, request)
    store.flushall()
    yield store
    store.flushall()


def writers(client: RedisClient) -> tuple[RedisIndex, RedisIndex]:
    return RedisIndex(client, SCHEMA, owner="a#1"), RedisIndex(client, SCHEMA, owner="b#2")


def stored(key: int) -> tuple[OpKind, Tier, int, int]:
    return (OpKind.STORE, Tier.GPU, key, key)


def held(index: RedisIndex, *keys: int) -> int:
    return index.longest_prefix(list(keys), [S])[S].num_blocks


def test_the_first_fenced_writer_of_a_stream_owns_it(client: RedisClient) -> None:
    a, b = writers(client)
    a.apply(S, 0, 1.0, [stored(1)])
    assert a.owner(S) == "a#1"
    with pytest.raises(FencedError):
        b.apply(S, 1, 2.0, [stored(2)])
    assert held(a, 1, 2) == 1
    assert a.stats(S).watermark == 0


def test_a_claim_fences_the_previous_owner_out_whole(client: RedisClient) -> None:
    a, b = writers(client)
    a.apply(S, 0, 1.0, [stored(1)])
    b.claim(S)
    resume_from = b.stats(S).watermark
    with pytest.raises(FencedError):
        a.apply_many(S, [(1, 2.0, [stored(2)]), (2, 3.0, [stored(3)])])
    assert b.stats(S).watermark == resume_from == 0
    assert held(b, 1, 2) == 1
    b.apply(S, 1, 2.0, [stored(2)])
    assert held(b, 1, 2) == 2


def test_a_fenced_clear_keeps_the_stream_and_an_owned_one_keeps_the_owner(
    client: RedisClient,
) -> None:
    a, b = writers(client)
    a.apply(S, 5, 1.0, [stored(1)])
    with pytest.raises(FencedError):
        b.clear(S)
    assert held(a, 1) == 1
    assert a.stats(S).watermark == 5
    a.clear(S)
    assert held(a, 1) == 0
    assert a.stats(S).watermark == -1
    assert a.owner(S) == "a#1"
    with pytest.raises(FencedError):
        b.apply(S, 0, 1.0, [stored(1)])
    a.apply(S, 0, 1.0, [stored(1)])
    assert S in a.streams()  # a cleared stream is listed again by its next batch


def test_an_unfenced_writer_is_unaffected_and_claims_nothing(client: RedisClient) -> None:
    a = RedisIndex(client, SCHEMA)
    a.apply(S, 0, 1.0, [stored(1)])
    a.claim(S)
    assert a.owner(S) is None
    a.clear(S)
    assert a.stats(S).watermark == -1


def test_the_owner_lives_in_the_stream_own_meta_hash(client: RedisClient) -> None:
    a, _ = writers(client)
    a.claim(S)
    assert client.hget(a.schema.stream(S).meta, META_OWNER) == b"a#1"
