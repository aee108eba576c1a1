"""kvindex.api.load.store: backend specifics (the shared behaviour: tests/contract)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import fakeredis
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvindex.api.load.store import MemoryLoadStore, RedisLoadStore
from kvindex.indexer.index.protocol import IndexUnavailableError
from kvindex.indexer.redis_schema import Schema
from tests.support.redis_server import free_port
from tests.unit.api.load.samples import NOW, a_load


def test_load_key_name() -> None:
    assert Schema("p").load == "p:v1:load"
    assert Schema().load == "kvindex:v1:load"


def test_memory_store_is_thread_safe_and_keeps_the_newest() -> None:
    store = MemoryLoadStore()

    def writer(offset: int) -> None:
        for i in range(500):
            store.put("r1", a_load(ts=float(i * 8 + offset)))

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.get_many(["r1"])["r1"].ts == 499 * 8 + 7


def test_redis_store_layout_is_one_hash_of_json() -> None:
    client = fakeredis.FakeRedis()
    store = RedisLoadStore(client, Schema("p"))
    store.put("r1", a_load(running=3.0))
    assert client.keys("*") == [b"p:v1:load"]
    raw = client.hget("p:v1:load", "r1")
    assert isinstance(raw, bytes)
    assert json.loads(raw) == {
        "running": 3.0,
        "waiting": 2.0,
        "kv_usage": 0.5,
        "ts": NOW,
        "source": "push",
    }
    store.close()


def test_two_redis_stores_on_one_server_agree() -> None:
    server = fakeredis.FakeServer()
    first = RedisLoadStore(fakeredis.FakeRedis(server=server), Schema("p"))
    second = RedisLoadStore(fakeredis.FakeRedis(server=server), Schema("p"))
    first.put("r1", a_load(ts=2.0, source="push"))
    second.put("r1", a_load(ts=1.0, source="scrape"))
    assert first.get_many(["r1"]) == second.get_many(["r1"]) == {"r1": a_load(ts=2.0)}
    second.remove("r1")
    assert first.get_many(["r1"]) == {}
    first.close()
    second.close()


def test_prefixes_do_not_share_load() -> None:
    client = fakeredis.FakeRedis()
    RedisLoadStore(client, Schema("a")).put("r1", a_load())
    assert RedisLoadStore(client, Schema("b")).get_many(["r1"]) == {}


@pytest.mark.parametrize("junk", [b"not json", b'{"running": -1}', b"[1, 2]"])
def test_an_undecodable_stored_value_reads_as_absent_and_is_replaced(junk: bytes) -> None:
    client = fakeredis.FakeRedis()
    store = RedisLoadStore(client, Schema("p"))
    client.hset("p:v1:load", "r1", junk)
    assert store.get_many(["r1"]) == {}
    store.put("r1", a_load(ts=1.0))
    assert store.get_many(["r1"]) == {"r1": a_load(ts=1.0)}


def test_answer_counts_are_a_field_of_the_load_hash() -> None:
    client = fakeredis.FakeRedis()
    store = RedisLoadStore(client, Schema("p"))
    store.put("r1", a_load(ts=1.5))
    store.get_counted(["r1"], ["r1"] * 2)
    assert client.keys("*") == [b"p:v1:load"]
    assert client.hget("p:v1:load", "r1/answers") == b"2"
    assert store.get_many(["r1"]) == {"r1": a_load(ts=1.5)}
    store.remove("r1")
    assert client.keys("*") == []


@pytest.mark.parametrize("junk", [b"", b"garbage", b"-3"])
def test_an_unreadable_answer_count_reads_as_0_and_a_new_load_resets_it(junk: bytes) -> None:
    client = fakeredis.FakeRedis()
    store = RedisLoadStore(client, Schema("p"))
    store.put("r1", a_load(ts=1.5))
    client.hset("p:v1:load", "r1/answers", junk)
    assert store.get_counted(["r1"])["r1"].routed == 0
    assert store.get_counted(["r1"], ["r1"])["r1"].routed == 0  # no crash, still 0
    store.put("r1", a_load(ts=2.0))
    assert store.get_counted(["r1"], ["r1"])["r1"].routed == 1


@pytest.fixture
def dead_redis() -> Iterator[redis.Redis]:
    """A client of a loopback port nothing listens on, without retries."""
    client = redis.Redis(
        host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)
    )
    yield client
    client.close()


def test_redis_down_is_index_unavailable(dead_redis: redis.Redis) -> None:
    store = RedisLoadStore(dead_redis, Schema("p"))
    with pytest.raises(IndexUnavailableError, match="redis"):
        store.put("r1", a_load())
    with pytest.raises(IndexUnavailableError, match="redis"):
        store.get_many(["r1"])
    with pytest.raises(IndexUnavailableError, match="redis"):
        store.remove("r1")
    with pytest.raises(IndexUnavailableError, match="redis"):
        store.get_counted(["r1"], ["r1"])
