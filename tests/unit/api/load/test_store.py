"""kvindex.api.load.store: backend specifics (the shared behaviour: tests/contract)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import cast
from unittest.mock import patch

import fakeredis
import pytest
import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from kvindex.api.load.model import CountedLoad
from kvindex.api.load.reservations import Reservations
from kvindex.api.load.store import CircuitLoadStore, LoadChanges, MemoryLoadStore, RedisLoadStore
from kvindex.indexer.index.circuit import StoreCircuit
from kvindex.indexer.index.protocol import IndexUnavailableError
from kvindex.indexer.redis.lua import lua_script
from kvindex.indexer.redis.schema import (
    ANSWERS_SUFFIX,
    LOAD_EPOCH,
    LOAD_SEQ,
    LOAD_TRIMMED,
    MAX_LOAD_TOMBSTONES,
    Schema,
)
from tests.support.redis_server import free_port
from tests.unit.api.load.samples import NOW, a_load

LOAD = "p:v2:{load}:loads"
CHANGES = "p:v2:{load}:changes"
REMOVED = "p:v2:{load}:removed"


def test_load_key_names() -> None:
    schema = Schema("p")
    assert (schema.load, schema.load_changes, schema.load_removed) == (LOAD, CHANGES, REMOVED)
    assert Schema().load == "kvindex:v2:{load}:loads"
    # One hash tag: a put, a count and a removal change the hash and its log in one script.
    assert len({key_slot(k.encode()) for k in (LOAD, CHANGES, REMOVED)}) == 1


def test_the_scripts_name_the_log_fields_of_the_schema() -> None:
    prelude = lua_script("kvindex.api.load.store", "load_log.lua")
    names = f"'{LOAD_EPOCH}', '{LOAD_SEQ}', '{LOAD_TRIMMED}'"
    assert f"local EPOCH, SEQ, TRIMMED = {names}\n" in prelude
    assert f"local ANSWERS = '{ANSWERS_SUFFIX}'\n" in prelude


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


def test_redis_store_layout_is_one_hash_of_json_and_its_change_log() -> None:
    client = fakeredis.FakeRedis()
    store = RedisLoadStore(client, Schema("p"))
    store.put("r1", a_load(running=3.0))
    assert sorted(client.keys("*")) == [CHANGES.encode(), LOAD.encode()]
    assert client.hget(LOAD, "#seq") == b"1"
    assert client.zrange(CHANGES, 0, -1, withscores=True) == [(b"r1", 1.0)]
    raw = client.hget(LOAD, "r1")
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
    client.hset(LOAD, "r1", junk)
    assert store.get_many(["r1"]) == {}
    store.put("r1", a_load(ts=1.0))
    assert store.get_many(["r1"]) == {"r1": a_load(ts=1.0)}


def test_answer_counts_are_a_field_of_the_load_hash() -> None:
    client = fakeredis.FakeRedis()
    store = RedisLoadStore(client, Schema("p"))
    store.put("r1", a_load(ts=1.5))
    store.get_counted(["r1"], ["r1"] * 2)
    assert client.hget(LOAD, "r1/answers") == b"2"
    assert client.hget(LOAD, "#seq") == b"3"  # the put and each answer: one change each
    assert store.get_many(["r1"]) == {"r1": a_load(ts=1.5)}
    store.remove("r1")
    assert sorted(client.hkeys(LOAD)) == [b"#epoch", b"#seq"]  # the log's own fields
    assert client.zrange(REMOVED, 0, -1, withscores=True) == [(b"r1", 4.0)]
    assert client.zcard(CHANGES) == 0


def test_tombstones_are_bounded_and_a_reader_behind_them_reads_everything() -> None:
    client = fakeredis.FakeRedis()
    store, behind = RedisLoadStore(client, Schema("p")), RedisLoadStore(client, Schema("p"))
    store.put("keep", a_load(ts=1.0))
    for i in range(3):
        store.put(f"r{i}", a_load(ts=1.0))
    assert set(behind.get_counted(["keep", "r0", "r1", "r2"])) == {"keep", "r0", "r1", "r2"}
    for i in range(MAX_LOAD_TOMBSTONES + 2):
        store.put(f"gone{i}", a_load(ts=1.0))
        store.remove(f"gone{i}")
    store.remove("r0")
    assert client.zcard(REMOVED) == MAX_LOAD_TOMBSTONES
    assert int(client.hget(LOAD, "#trimmed") or 0) > 0
    assert set(behind.get_counted(["keep", "r0", "r1", "r2"])) == {"keep", "r1", "r2"}


def test_a_read_of_nothing_new_returns_the_snapshot_it_holds() -> None:
    client = fakeredis.FakeRedis()
    store = RedisLoadStore(client, Schema("p"))
    store.put("r1", a_load(ts=1.0))
    first = store.get_counted(["r1"])
    again = store.get_counted(["r1"])
    assert first == again and first is not again  # a dict of the caller's own
    assert first["r1"] is again["r1"]  # ... of entries made once per change


@pytest.mark.parametrize("junk", [b"", b"garbage", b"-3"])
def test_an_unreadable_answer_count_reads_as_0_and_a_new_load_resets_it(junk: bytes) -> None:
    client = fakeredis.FakeRedis()
    store = RedisLoadStore(client, Schema("p"))
    store.put("r1", a_load(ts=1.5))
    client.hset(LOAD, "r1/answers", junk)
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


def test_after_redis_was_unreachable_the_next_read_is_whole() -> None:
    """A Redis back on older data (restarted from an old snapshot) may have made as many
    changes since as the reader had seen: only a whole read is right then."""
    server = fakeredis.FakeServer()
    client = fakeredis.FakeRedis(server=server)
    store = RedisLoadStore(client, Schema("p"))
    writer = RedisLoadStore(fakeredis.FakeRedis(server=server), Schema("p"))
    writer.put("r1", a_load(ts=1.0))
    old_hash = cast("dict[bytes, bytes]", client.hgetall(LOAD))
    old_changes = cast("list[tuple[bytes, float]]", client.zrange(CHANGES, 0, -1, withscores=True))
    writer.put("r1", a_load(ts=2.0))
    assert store.get_counted(["r1"]) == {"r1": CountedLoad(a_load(ts=2.0), 0)}
    server.connected = False
    with pytest.raises(IndexUnavailableError, match="redis"):
        store.get_counted(["r1"], ["r1"])
    server.connected = True
    client.delete(LOAD, CHANGES)  # back on the older data, then changes beyond the reader's
    for field, value in old_hash.items():
        client.hset(LOAD, field, value)
    client.zadd(CHANGES, dict(old_changes))
    for ts in (1.0, 2.0, 3.0):
        writer.put("r2", a_load(ts=ts))
    assert store.get_counted(["r1", "r2"]) == {
        "r1": CountedLoad(a_load(ts=1.0), 0),
        "r2": CountedLoad(a_load(ts=3.0), 0),
    }


# --- the change log a reader follows (LoadChanges) ---------------------------------------------


def _changed(store: LoadChanges, version: int) -> set[str] | None:
    changed = store.changed_since(version)
    return None if changed is None else set(changed)


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_the_snapshot_says_which_replicas_changed_since_a_version(kind: str) -> None:
    store: MemoryLoadStore | RedisLoadStore
    store = MemoryLoadStore() if kind == "memory" else RedisLoadStore(fakeredis.FakeRedis())
    store.put("a", a_load(ts=1.0))
    store.put("b", a_load(ts=1.0))
    store.get_counted(["a", "b"])
    start = store.change_version()
    assert _changed(store, start) == set()
    store.get_counted(["a", "b"], ["a"])  # an answer counted: a's entry changes
    assert _changed(store, start) == {"a"}
    after_a = store.change_version()
    store.put("b", a_load(ts=2.0))
    store.get_counted(["a", "b"])  # Redis: seen by the snapshot at the next read
    assert _changed(store, start) == {"a", "b"}
    assert _changed(store, after_a) == {"b"}
    store.remove("a")
    store.get_counted(["a", "b"])
    assert _changed(store, after_a) == {"a", "b"}
    assert store.changed_since(store.change_version()) == []
    assert store.changed_since(store.change_version() + 1) is None  # not a version it had


def test_requests_in_flight_that_come_and_go_are_changes() -> None:
    store = MemoryLoadStore()
    store.put("a", a_load(ts=1.0))
    reservations = Reservations(store.ledger, 60.0, holder="proxy")
    store.get_counted(["a", "b"])
    start = store.change_version()
    lease = reservations.reserve("b", 100)
    assert store.get_counted(["a", "b"])["b"].in_flight.num_requests == 1
    assert _changed(store, start) == {"b"}
    middle = store.change_version()
    store.get_counted(["a", "b"])  # the same totals: nothing new
    assert _changed(store, middle) == set()
    reservations.release(lease)
    assert "b" not in store.get_counted(["a", "b"])
    assert _changed(store, middle) == {"b"}


def test_a_snapshot_read_whole_again_forgets_what_changed_before() -> None:
    """After Redis was unreachable the snapshot is emptied: a reader of an older version is
    told to start again (None), not given a partial list."""
    client = fakeredis.FakeRedis()
    store = RedisLoadStore(client, Schema("p"))
    store.put("a", a_load(ts=1.0))
    store.get_counted(["a"])
    before = store.change_version()
    down = patch.object(store, "_read_changes", side_effect=IndexUnavailableError("down"))
    with down, pytest.raises(IndexUnavailableError):
        store.get_counted(["a"])
    store.get_counted(["a"])
    assert store.changed_since(before) is None
    assert store.changed_since(store.change_version()) == []


def test_the_circuit_wrapper_passes_the_change_log_through() -> None:
    inner = MemoryLoadStore()
    wrapped = CircuitLoadStore(inner, StoreCircuit(1.0))
    inner.put("a", a_load(ts=1.0))
    assert isinstance(wrapped, LoadChanges)
    assert wrapped.change_version() == inner.change_version() > 0
    assert wrapped.changed_since(0) == ["a"]
