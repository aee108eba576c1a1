"""The load-store contract, run on every backend: ``memory`` (:class:`MemoryLoadStore`),
``fakeredis`` (:class:`RedisLoadStore` over an in-process fake whose Lua runs in lupa),
``redis`` (over the private redis-server of ``tests/conftest.py``) and ``cluster`` (over its
private 3-master Redis Cluster).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from kvindex.api.load.model import CountedLoad, Load
from kvindex.api.load.store import LoadStore, MemoryLoadStore, RedisLoadStore
from kvindex.indexer.redis.schema import Schema, SchemaError
from tests.contract.conftest import BACKENDS, REDIS_BACKENDS, redis_store_client


def _redis_store(backend: str, request: pytest.FixtureRequest) -> RedisLoadStore:
    return RedisLoadStore(redis_store_client(backend, request), Schema("test"))


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest) -> Iterator[LoadStore]:
    """An empty load store on the backend under test, closed afterwards."""
    backend: str = request.param
    made = MemoryLoadStore() if backend == "memory" else _redis_store(backend, request)
    yield made
    made.close()


@pytest.fixture(params=REDIS_BACKENDS)
def shared_store(request: pytest.FixtureRequest) -> Iterator[RedisLoadStore]:
    """An empty store that several API processes can share (Redis)."""
    made = _redis_store(request.param, request)
    yield made
    made.close()


def load(ts: float, *, running: float = 1.0, source: str = "push") -> Load:
    return Load(running=running, waiting=2.0, kv_usage=0.25, ts=ts, source=source)


def test_put_then_get(store: LoadStore) -> None:
    store.put("r1", load(100.0))
    assert store.get_many(["r1"]) == {"r1": load(100.0)}


def test_missing_replicas_are_absent(store: LoadStore) -> None:
    assert store.get_many(["r1", "r2"]) == {}
    store.put("r1", load(100.0))
    assert store.get_many(["r2", "r1", "r3"]) == {"r1": load(100.0)}


def test_get_many_of_nothing(store: LoadStore) -> None:
    store.put("r1", load(100.0))
    assert store.get_many([]) == {}


def test_get_many_with_a_repeated_replica(store: LoadStore) -> None:
    store.put("r1", load(100.0))
    assert store.get_many(["r1", "r1"]) == {"r1": load(100.0)}


def test_replicas_are_independent(store: LoadStore) -> None:
    store.put("r1", load(100.0, running=1.0))
    store.put("r2", load(50.0, running=9.0))
    assert store.get_many(["r1", "r2"]) == {
        "r1": load(100.0, running=1.0),
        "r2": load(50.0, running=9.0),
    }


def test_remove(store: LoadStore) -> None:
    store.put("r1", load(100.0))
    store.put("r2", load(100.0))
    store.remove("r1")
    assert store.get_many(["r1", "r2"]) == {"r2": load(100.0)}


def test_remove_unknown_is_a_noop(store: LoadStore) -> None:
    store.remove("nobody")
    assert store.get_many(["nobody"]) == {}


def test_put_after_remove_starts_over(store: LoadStore) -> None:
    store.put("r1", load(100.0))
    store.remove("r1")
    store.put("r1", load(10.0))
    assert store.get_many(["r1"]) == {"r1": load(10.0)}


def test_newer_replaces_older(store: LoadStore) -> None:
    store.put("r1", load(100.0, source="scrape"))
    store.put("r1", load(101.0, running=7.0, source="push"))
    assert store.get_many(["r1"]) == {"r1": load(101.0, running=7.0, source="push")}


def test_older_never_replaces_newer(store: LoadStore) -> None:
    # A late scrape must not hide a fresh push ...
    store.put("r1", load(101.0, running=7.0, source="push"))
    store.put("r1", load(100.0, source="scrape"))
    assert store.get_many(["r1"]) == {"r1": load(101.0, running=7.0, source="push")}


def test_older_push_never_replaces_newer_scrape(store: LoadStore) -> None:
    # ... nor a late push a fresh scrape.
    store.put("r1", load(200.5, running=3.0, source="scrape"))
    store.put("r1", load(200.25, running=8.0, source="push"))
    assert store.get_many(["r1"]) == {"r1": load(200.5, running=3.0, source="scrape")}


def test_equal_timestamps_the_later_put_wins(store: LoadStore) -> None:
    store.put("r1", load(100.0, running=1.0))
    store.put("r1", load(100.0, running=2.0))
    assert store.get_many(["r1"]) == {"r1": load(100.0, running=2.0)}


def test_sub_millisecond_order_is_kept(store: LoadStore) -> None:
    early, late = 1_700_000_000.000001, 1_700_000_000.000002
    store.put("r1", load(late, running=2.0))
    store.put("r1", load(early, running=1.0))
    assert store.get_many(["r1"])["r1"].ts == late


@pytest.mark.parametrize(
    "value",
    [
        Load(running=0.0, waiting=0.0, kv_usage=0.0, ts=0.0, source="push"),
        Load(running=3.0, waiting=17.0, kv_usage=1.0, ts=1_700_000_123.456789, source="scrape"),
        Load(running=0.1, waiting=1e9, kv_usage=0.30000000000000004, ts=1e-6, source="push"),
    ],
)
def test_round_trip_is_exact(store: LoadStore, value: Load) -> None:
    store.put("r1", value)
    got = store.get_many(["r1"])["r1"]
    assert got == value
    assert (got.running, got.waiting, got.kv_usage, got.ts) == (
        value.running,
        value.waiting,
        value.kv_usage,
        value.ts,
    )


def test_replica_ids_with_the_allowed_punctuation(store: LoadStore) -> None:
    store.put("pool-a.r1:0_x", load(1.0))
    assert store.get_many(["pool-a.r1:0_x"]) == {"pool-a.r1:0_x": load(1.0)}


@pytest.mark.parametrize("replica", ["", "a/b", "a{b}", "a b"])
def test_unusable_replica_ids_are_rejected(store: LoadStore, replica: str) -> None:
    with pytest.raises(SchemaError, match="replica id"):
        store.put(replica, load(1.0))


# --- answers counted since the load was stored ----------------------------------------------


def counted(store: LoadStore, *replicas: str, answers: Sequence[str] = ()) -> dict[str, int]:
    """Answers counted per replica (replicas without a load are absent)."""
    return {r: c.routed for r, c in store.get_counted(list(replicas), answers).items()}


def test_get_counted_reads_loads_and_no_answers_yet(store: LoadStore) -> None:
    store.put("r1", load(100.0))
    assert store.get_counted(["r1", "r2"]) == {"r1": CountedLoad(load(100.0), 0)}
    assert store.get_counted([]) == {}
    assert store.get_counted(["r1", "r1"]) == {"r1": CountedLoad(load(100.0), 0)}


def test_answers_are_counted_before_the_read(store: LoadStore) -> None:
    store.put("r1", load(100.0))
    store.put("r2", load(50.0))
    assert counted(store, "r1", "r2", answers=["r1", "r1"]) == {"r1": 2, "r2": 0}
    assert counted(store, "r1", answers=["r1", "r2"]) == {"r1": 3}
    assert counted(store, "r1", "r2") == {"r1": 3, "r2": 1}
    assert counted(store, answers=["r2"]) == {}
    assert counted(store, "r2") == {"r2": 2}


def test_a_newer_load_starts_the_count_again(store: LoadStore) -> None:
    store.put("r1", load(100.0))
    counted(store, answers=["r1"] * 3)
    store.put("r1", load(100.5))
    assert counted(store, "r1") == {"r1": 0}
    assert counted(store, "r1", answers=["r1"]) == {"r1": 1}


def test_the_same_measurement_again_keeps_the_count(store: LoadStore) -> None:
    store.put("r1", load(100.0))
    counted(store, answers=["r1"] * 2)
    store.put("r1", load(100.0, running=3.0))  # equal ts: stored, but no new measurement
    assert counted(store, "r1") == {"r1": 2}


def test_an_older_load_keeps_the_count(store: LoadStore) -> None:
    store.put("r1", load(100.0))
    counted(store, answers=["r1"] * 2)
    store.put("r1", load(99.0))  # not stored
    assert counted(store, "r1") == {"r1": 2}


def test_answers_before_the_first_load_are_dropped_by_it(store: LoadStore) -> None:
    counted(store, answers=["r1"])
    store.put("r1", load(100.0))
    assert counted(store, "r1") == {"r1": 0}


def test_remove_forgets_the_answers(store: LoadStore) -> None:
    store.put("r1", load(100.0))
    counted(store, answers=["r1"])
    store.remove("r1")
    assert counted(store, "r1") == {}
    store.put("r1", load(10.0))
    assert counted(store, "r1") == {"r1": 0}


def test_answers_from_every_process_on_one_store_add_up(shared_store: RedisLoadStore) -> None:
    store = shared_store
    other = RedisLoadStore(store.client, Schema("test"))  # a second API process's store
    store.put("r1", load(100.0))
    counted(store, answers=["r1"])
    assert counted(other, "r1", answers=["r1"]) == {"r1": 2}
    assert counted(store, "r1") == {"r1": 2}


# --- scrape claims ----------------------------------------------------------------------------


def test_a_lone_process_claims_every_replica(store: LoadStore) -> None:
    assert store.claim_scrapes(["r1", "r2", "r1"], 10.0) == {"r1", "r2"}
    assert store.claim_scrapes([], 10.0) == set()
    if isinstance(store, MemoryLoadStore):  # one process: nobody else to leave it to
        assert store.claim_scrapes(["r1"], 10.0) == {"r1"}


def test_each_replica_is_claimed_once_until_the_claim_expires(
    shared_store: RedisLoadStore,
) -> None:
    other = RedisLoadStore(shared_store.client, Schema("test"))  # a second API process
    assert shared_store.claim_scrapes(["r1"], 0.2) == {"r1"}
    assert other.claim_scrapes(["r1", "r2"], 0.2) == {"r2"}
    assert shared_store.claim_scrapes(["r1", "r2"], 0.2) == set()
    time.sleep(0.3)
    assert other.claim_scrapes(["r1", "r2"], 0.2) == {"r1", "r2"}


# --- reads that follow the store's changes ------------------------------------------------------
# Each store keeps what it read and, on Redis, reads only what changed since (the module
# ``kvindex.api.load.store`` says how): these hold that such a read is still the whole truth.


def counted_loads(store: LoadStore, *replicas: str) -> dict[str, tuple[float, int]]:
    """(load ts, answers) per replica with a load, as a read now returns it."""
    return {
        r: (c.load.ts, c.routed)
        for r, c in store.get_counted(list(replicas)).items()
        if c.load is not None
    }


def test_reads_of_different_replica_lists_follow_every_change(store: LoadStore) -> None:
    store.put("r1", load(1.0))
    store.put("r2", load(2.0))
    assert counted_loads(store, "r1", "r2") == {"r1": (1.0, 0), "r2": (2.0, 0)}
    assert counted_loads(store, "r2") == {"r2": (2.0, 0)}
    store.put("r2", load(3.0))
    store.get_counted(["r1"], ["r2", "r1"])
    store.put("r3", load(4.0))
    assert counted_loads(store, "r2") == {"r2": (3.0, 1)}
    assert counted_loads(store, "r1", "r2", "r3") == {
        "r1": (1.0, 1),
        "r2": (3.0, 1),
        "r3": (4.0, 0),
    }
    store.remove("r2")
    assert counted_loads(store, "r2") == {}
    assert counted_loads(store, "r3", "r2", "r1") == {"r1": (1.0, 1), "r3": (4.0, 0)}


def test_a_read_is_the_callers_own(store: LoadStore) -> None:
    store.put("r1", load(1.0))
    first = store.get_counted(["r1"])
    first.clear()
    store.put("r2", load(2.0))
    second = store.get_counted(["r1", "r2"])
    assert set(second) == {"r1", "r2"}
    store.put("r1", load(5.0))
    assert second["r1"].load == load(1.0)  # an earlier read never changes under its caller


def test_another_process_puts_and_answers_are_seen_on_the_next_read(
    shared_store: RedisLoadStore,
) -> None:
    mine, other = shared_store, RedisLoadStore(shared_store.client, Schema("test"))
    mine.put("r1", load(100.0))
    assert counted_loads(mine, "r1", "r2") == {"r1": (100.0, 0)}
    other.put("r2", load(50.0))
    other.get_counted(["r1"], ["r1", "r1"])
    assert counted_loads(mine, "r1", "r2") == {"r1": (100.0, 2), "r2": (50.0, 0)}
    other.put("r1", load(101.0))  # a new measurement: its count starts again
    assert counted_loads(mine, "r1", "r2") == {"r1": (101.0, 0), "r2": (50.0, 0)}
    other.put("r2", load(49.0))  # older: not stored, nothing to see
    assert counted_loads(mine, "r2") == {"r2": (50.0, 0)}


def test_a_replica_another_process_removed_disappears(shared_store: RedisLoadStore) -> None:
    mine, other = shared_store, RedisLoadStore(shared_store.client, Schema("test"))
    mine.put("r1", load(100.0))
    mine.put("r2", load(100.0))
    mine.get_counted(["r1"], ["r1"])
    assert counted_loads(mine, "r1", "r2") == {"r1": (100.0, 1), "r2": (100.0, 0)}
    other.remove("r1")
    assert counted_loads(mine, "r1", "r2") == {"r2": (100.0, 0)}
    other.put("r1", load(10.0))  # back again: a new replica as far as load goes
    assert counted_loads(mine, "r1", "r2") == {"r1": (10.0, 0), "r2": (100.0, 0)}


@pytest.mark.parametrize("writes_after", [0, 1, 40])
def test_a_flushed_redis_is_read_again_whole(
    shared_store: RedisLoadStore, writes_after: int
) -> None:
    """FLUSHALL (or a Redis restarted empty) forgets the change log with the loads; a
    reader notices by the log's identity, also once as many changes as it had seen (or
    more) were made since, and reads the store as it now is."""
    mine, other = shared_store, RedisLoadStore(shared_store.client, Schema("test"))
    for i in range(8):
        other.put(f"r{i}", load(100.0 + i))
    other.get_counted([], ["r0"] * 3)
    names = [f"r{i}" for i in range(8)]
    assert len(counted_loads(mine, *names)) == 8
    shared_store.client.flushall()
    for i in range(writes_after):
        other.put(f"r{i % 2}", load(200.0 + i))
    expected = {f"r{i % 2}": (200.0 + i, 0) for i in range(writes_after)}
    assert counted_loads(mine, *names) == expected
    assert counted_loads(mine, *names) == expected
    other.get_counted([], ["r0"])
    if writes_after:  # and it follows the new log's changes from there
        assert counted_loads(mine, "r0") == {"r0": (expected["r0"][0], 1)}


def test_an_undecodable_value_reads_as_absent_whole_or_changed(
    shared_store: RedisLoadStore,
) -> None:
    mine, other = shared_store, RedisLoadStore(shared_store.client, Schema("test"))
    mine.put("r1", load(100.0))
    mine.put("r2", load(100.0))
    assert len(counted_loads(mine, "r1", "r2")) == 2
    shared_store.client.hset(Schema("test").load, "r1", b"not json")
    other.get_counted([], ["r1"])  # a change of r1: read again by the next read
    assert counted_loads(mine, "r1", "r2") == {"r2": (100.0, 0)}
    fresh = RedisLoadStore(shared_store.client, Schema("test"))  # reads it whole
    assert counted_loads(fresh, "r1", "r2") == {"r2": (100.0, 0)}
    other.put("r1", load(1.0))  # replaces the junk
    assert counted_loads(mine, "r1", "r2") == {"r1": (1.0, 0), "r2": (100.0, 0)}
    assert counted_loads(fresh, "r1", "r2") == {"r1": (1.0, 0), "r2": (100.0, 0)}


def test_reads_in_many_threads_while_another_process_writes_end_up_whole(
    shared_store: RedisLoadStore,
) -> None:
    """Replies of reads made at once may arrive out of order: none may undo a newer one."""
    mine, other = shared_store, RedisLoadStore(shared_store.client, Schema("test"))
    names = [f"r{i}" for i in range(6)]
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            mine.get_counted(names, ["r0"])

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        for step in range(60):
            other.put(names[step % 6], load(float(step)))
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    read = mine.get_counted(names)
    assert {r: c.load for r, c in read.items()} == other.get_many(names)
    assert {r: c.routed for r, c in read.items()} == {
        r: c.routed
        for r, c in RedisLoadStore(mine.client, Schema("test")).get_counted(names).items()
    }


def test_an_unreadable_count_fails_alone_and_the_read_goes_on(shared_store: RedisLoadStore) -> None:
    """The count is HINCRBY'd inside the read's script: its error must not stop the read
    nor the other answers' counts."""
    store = shared_store
    store.put("r1", load(100.0))
    store.put("r2", load(100.0))
    store.client.hset(Schema("test").load, "r1/answers", b"garbage")
    assert counted(store, "r1", "r2", answers=["r1", "r2"]) == {"r1": 0, "r2": 1}
    store.put("r1", load(101.0))  # a newer load: its count starts again, readable
    assert counted(store, "r1", "r2", answers=["r1"]) == {"r1": 1, "r2": 1}
