"""FleetSync and RedisFleetView specifics (the shared behaviour is the registry-view
contract in ``tests/contract``): bind-mode replicas shared, errors counted, caching,
expiry of an indexer's records, undecodable values skipped, a sharded indexer's records
fenced by its lease, and orphaned streams."""

from __future__ import annotations

import fakeredis
import pytest

from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.domain.health import StreamHealth, StreamReport, UnroutedCounters
from kvindex.indexer.fleet.registry import Freshness, Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.fleet.sync import FleetSync, StreamRecord, encode_record, encode_spec
from kvindex.indexer.fleet.view import RedisFleetView
from kvindex.indexer.index.circuit import StoreCircuit
from kvindex.indexer.index.protocol import IndexUnavailableError
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.ingest.membership import Membership, Shard
from kvindex.indexer.redis.schema import UNROUTED_FIELD, Schema
from tests.support.clock import Clock

SCHEMA = Schema("test")
R1 = ReplicaSpec("r1", "m", events="tcp://127.0.0.1:5557")
R2 = ReplicaSpec("r2", "m", events="tcp://127.0.0.1:5558")
TTL = 9.0


def test_declared_replicas_are_published_at_start() -> None:
    client = fakeredis.FakeRedis()
    FleetSync(client, SCHEMA, Registry((R1,)), declared=(R1,)).tick()
    assert client.hget(SCHEMA.replicas, "r1") == encode_spec(R1)


def test_a_replica_learnt_by_the_indexer_is_shared_not_removed() -> None:
    client = fakeredis.FakeRedis()
    registry = Registry()
    sync = FleetSync(client, SCHEMA, registry)
    sync.tick()
    registry.add(R1)  # e.g. bind mode: registered from its first event's topic
    sync.tick()
    assert registry.get("r1") == R1
    assert RedisFleetView(client, SCHEMA).get("r1") == R1


def test_a_redis_error_is_counted_not_raised() -> None:
    registry = Registry((R1,))
    server = fakeredis.FakeServer()
    server.connected = False
    sync = FleetSync(fakeredis.FakeRedis(server=server), SCHEMA, registry, declared=(R1,))
    sync.tick()
    sync.tick()
    assert sync.num_errors == 2
    assert registry.get("r1") == R1


def test_the_view_serves_its_last_snapshot_when_redis_is_down() -> None:
    server = fakeredis.FakeServer()
    client = fakeredis.FakeRedis(server=server)
    clock = Clock()
    view = RedisFleetView(client, SCHEMA, cache_ttl_s=0.5, clock=clock)
    view.add(R1)
    assert view.replicas() == [R1]
    server.connected = False
    clock.now += 1.0
    assert view.replicas() == [R1]
    assert view.num_errors == 1
    with pytest.raises(IndexUnavailableError):
        view.add(ReplicaSpec("r2", "m"))


def test_reads_are_cached_for_the_ttl() -> None:
    client = fakeredis.FakeRedis()
    clock = Clock()
    view = RedisFleetView(client, SCHEMA, cache_ttl_s=0.5, clock=clock)
    assert view.replicas() == []
    client.hset(SCHEMA.replicas, "r1", encode_spec(R1))  # another process adds r1
    assert view.replicas() == []
    clock.now += 0.6
    assert view.replicas() == [R1]


def test_a_record_no_indexer_rewrites_is_stale() -> None:
    client = fakeredis.FakeRedis()
    clock = Clock()
    view = RedisFleetView(client, SCHEMA, record_expiry_s=10.0, cache_ttl_s=0.0, clock=clock)
    view.add(R1)
    health = StreamHealth(connected=True, last_heard=clock.now)
    client.hset(SCHEMA.stream_status, "r1/0", encode_record(StreamRecord(health, clock.now)))
    clock.now += 5.0
    assert [f.freshness for f in view.freshness()] == [Freshness.LIVE]
    clock.now += 6.0
    assert [f.freshness for f in view.freshness()] == [Freshness.STALE]


def test_undecodable_values_are_skipped() -> None:
    client = fakeredis.FakeRedis()
    view = RedisFleetView(client, SCHEMA, cache_ttl_s=0.0)
    view.add(R1)
    client.hset(SCHEMA.replicas, "bad", b"{not json")
    client.hset(SCHEMA.stream_status, "r1/0", b"[1, 2]")
    assert view.replicas() == [R1]
    assert view.statuses() == []
    assert view.stream_ids() == []


def test_a_fleet_lost_by_redis_is_republished_not_removed() -> None:
    client = fakeredis.FakeRedis()
    registry = Registry((R1,))
    sync = FleetSync(client, SCHEMA, registry, declared=(R1,))
    sync.tick()
    client.flushall()  # e.g. Redis restarted without persistence
    sync.tick()
    assert registry.get("r1") == R1
    assert RedisFleetView(client, SCHEMA).replicas() == [R1]


def test_removing_the_last_replica_is_not_a_lost_fleet() -> None:
    client = fakeredis.FakeRedis()
    registry = Registry((R1,))
    sync = FleetSync(client, SCHEMA, registry, declared=(R1,))
    sync.tick()
    assert RedisFleetView(client, SCHEMA).remove("r1") == R1
    sync.tick()
    assert registry.replicas() == []


def test_the_view_keeps_the_last_fleet_while_redis_has_lost_it() -> None:
    client = fakeredis.FakeRedis()
    sync = FleetSync(client, SCHEMA, Registry((R1,)), declared=(R1,))
    sync.tick()
    view = RedisFleetView(client, SCHEMA, cache_ttl_s=0.0)
    assert (view.replicas(), view.outage()) == ([R1], None)
    client.flushall()  # Redis restarted empty: no indexer has republished the fleet yet
    assert view.replicas() == [R1]
    outage = view.outage()
    assert outage is not None and "lost" in outage
    sync.tick()  # the indexer republishes it
    assert (view.replicas(), view.outage()) == ([R1], None)


def test_the_view_says_its_fleet_is_not_current_while_redis_is_down() -> None:
    server = fakeredis.FakeServer()
    view = RedisFleetView(fakeredis.FakeRedis(server=server), SCHEMA, cache_ttl_s=0.0)
    view.add(R1)
    assert view.outage() is None
    server.connected = False
    assert view.replicas() == [R1]
    outage = view.outage()
    assert outage is not None and "unreadable" in outage
    server.connected = True
    assert view.outage() is None


def test_the_view_reads_nothing_while_the_shared_circuit_is_open() -> None:
    client = fakeredis.FakeRedis()
    clock = Clock()
    circuit = StoreCircuit(1.0, clock=clock)
    view = RedisFleetView(client, SCHEMA, cache_ttl_s=0.0, clock=clock, circuit=circuit)
    view.add(R1)
    assert view.replicas() == [R1]

    def down() -> None:
        raise IndexUnavailableError("redis: timeout")

    with pytest.raises(IndexUnavailableError):
        circuit.call(down)  # e.g. an index lookup of the same process found Redis down
    client.hset(SCHEMA.replicas, "r2", encode_spec(ReplicaSpec("r2", "m")))
    clock.now += 5.0  # past the cool-down: reads still do not probe
    assert view.replicas() == [R1]
    assert view.outage() is not None
    circuit.call(lambda: None)  # another call's probe found Redis back
    assert [r.id for r in view.replicas()] == ["r1", "r2"]
    assert view.outage() is None


def test_the_bound_subs_unrouted_counters_reach_api_processes() -> None:
    client = fakeredis.FakeRedis()
    registry = Registry((R1,))
    registry.record(StreamId("r1"), StreamReport(connected=True))
    sync = FleetSync(client, SCHEMA, registry, declared=(R1,))
    view = RedisFleetView(client, SCHEMA, cache_ttl_s=0.0)
    sync.tick()
    assert view.unrouted() == UnroutedCounters()
    registry.record_unrouted(UnroutedCounters(num_undecodable=3, num_unidentified=2, num_refused=1))
    sync.tick()
    assert view.unrouted() == UnroutedCounters(3, 2, 1)
    assert [s.stream for s in view.statuses()] == [StreamId("r1")]  # not read as a stream
    client.hset(SCHEMA.stream_status, UNROUTED_FIELD, b"{not json")
    assert view.unrouted() == UnroutedCounters()


def test_a_sharded_indexer_names_itself_and_leaves_a_handed_over_stream_to_its_owner() -> None:
    client, registry = fakeredis.FakeRedis(), Registry((R1,))
    stream = StreamId("r1")
    registry.record(stream, StreamReport(last_seq=4))
    sync = FleetSync(client, SCHEMA, registry, declared=(R1,), owner="idx-a")
    sync.tick()
    view = RedisFleetView(client, SCHEMA, cache_ttl_s=0.0)
    assert [s.owner for s in view.statuses()] == ["idx-a"]
    registry.forget(stream)  # handed over: the new owner rewrites the record
    sync.tick()
    assert [s.owner for s in view.statuses()] == ["idx-a"]
    view.remove("r1")  # DELETE /replicas: its records go with it, and stay gone
    sync.tick()
    assert view.statuses() == []
    assert registry.replicas() == []


def test_a_sharded_indexers_records_need_its_lease_and_its_claim(server_clock: Clock) -> None:
    client, registry = fakeredis.FakeRedis(), Registry((R1, R2))
    a = Membership(client, SCHEMA, "idx-a", lease_ttl_s=TTL, clock=server_clock)
    shard = Shard(a, RedisIndex(client, SCHEMA))
    shard.tick()
    shard.claim(StreamId("r1"))  # r2 is another indexer's (never claimed here)
    for replica in ("r1", "r2"):
        registry.record(StreamId(replica), StreamReport(last_seq=4))
    sync = FleetSync(client, SCHEMA, registry, owner="idx-a", lease=lambda: a.token)
    sync.tick()
    assert set(client.hkeys(SCHEMA.stream_status)) == {b"r1/0", UNROUTED_FIELD.encode()}
    published = client.hgetall(SCHEMA.stream_status)
    server_clock.now += TTL + 1.0  # paused past its lease
    registry.record(StreamId("r1"), StreamReport(last_seq=9))
    sync.tick()
    assert client.hgetall(SCHEMA.stream_status) == published


def test_a_sharded_stream_reads_orphaned_until_a_live_indexer_claims_it(
    server_clock: Clock,
) -> None:
    client, stream = fakeredis.FakeRedis(), StreamId("r1")
    view = RedisFleetView(client, SCHEMA, cache_ttl_s=0.0, clock=server_clock)
    view.add(R1)
    a, b = (
        Membership(client, SCHEMA, i, lease_ttl_s=TTL, clock=server_clock)
        for i in ("idx-a", "idx-b")
    )
    shard_a = Shard(a, RedisIndex(client, SCHEMA))
    shard_a.tick()
    shard_a.claim(stream)
    health = StreamHealth(connected=True, last_heard=server_clock.now)
    record = StreamRecord(health, server_clock.now, "idx-a")
    client.hset(SCHEMA.stream_status, str(stream), encode_record(record))
    assert [s.freshness for s in view.statuses()] == [Freshness.LIVE]
    server_clock.now += TTL + 1.0
    assert [s.freshness for s in view.statuses()] == [Freshness.ORPHANED]
    assert [f.freshness for f in view.freshness()] == [Freshness.STALE]  # as scored
    shard_b = Shard(b, RedisIndex(client, SCHEMA))
    shard_b.tick()
    shard_b.claim(stream)  # taken over: kept again, the record rewritten by its new owner
    assert [s.freshness for s in view.statuses()] != [Freshness.ORPHANED]


def test_a_partial_view_is_published_read_partial_and_resumed_by_the_next_indexer() -> None:
    client = fakeredis.FakeRedis()
    clock = Clock()
    first = Registry((R1,), clock=clock)
    FleetSync(client, SCHEMA, first, clock=clock).tick()
    stream = StreamId("r1")
    first.record(stream, StreamReport(connected=True, partial="replay_gap_past_buffer"))
    since = clock.now
    FleetSync(client, SCHEMA, first, clock=clock).tick()
    view = RedisFleetView(client, SCHEMA, cache_ttl_s=0.0, clock=clock)
    [status] = view.freshness()
    assert (status.freshness, status.partial, status.partial_since) == (
        Freshness.PARTIAL,
        "replay_gap_past_buffer",
        since,
    )
    clock.now += 60.0  # the indexer restarts
    second = Registry((R1,), clock=clock)
    FleetSync(client, SCHEMA, second, clock=clock)
    assert second.resume_partial(stream) == "replay_gap_past_buffer"
    health = second.records()[stream]
    assert (health.partial, health.partial_since) == ("replay_gap_past_buffer", since)
    assert second.resume_partial(StreamId("r1", 1)) is None  # never published
    first.record(stream, StreamReport(partial=""))  # whole again
    FleetSync(client, SCHEMA, first, clock=clock).tick()
    assert Registry((R1,)).resume_partial(stream) is None  # no lookup: nothing resumed
    third = Registry((R1,), clock=clock)
    FleetSync(client, SCHEMA, third, clock=clock)
    assert third.resume_partial(stream) is None


def test_a_proxys_ask_to_clear_reaches_the_indexers_registry_once_and_new_only() -> None:
    client = fakeredis.FakeRedis()
    view = RedisFleetView(client, SCHEMA)
    view.ask_clear("r1", at=100.0)  # made before this indexer started: old news
    registry = Registry((R1, R2))
    sync = FleetSync(client, SCHEMA, registry, declared=(R1, R2))
    sync.tick()
    assert registry.clear_asks() == {}
    view.ask_clear("r2", at=200.0)
    client.hset(SCHEMA.clear_asks, "r3", b"not a time")
    sync.tick()
    assert registry.clear_asks() == {"r2": 200.0}
    view.ask_clear("r1", at=300.0)
    sync.tick()
    sync.tick()
    assert registry.clear_asks() == {"r1": 300.0, "r2": 200.0}
