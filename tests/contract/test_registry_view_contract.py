"""The :class:`RegistryView` contract, run on every backend: ``memory`` (the in-process
:class:`Registry`), ``fakeredis``, ``redis`` and ``cluster`` (:class:`RedisFleetView`
reading what an indexer's :class:`FleetSync` wrote from its own registry).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.fleet.registry import Freshness, Registry, RegistryView
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.fleet.replica_health import HEALTHY, Ejection, HealthPolicy, ReplicaHealth
from kvindex.indexer.fleet.sync import FleetSync
from kvindex.indexer.fleet.view import RedisFleetView
from kvindex.indexer.redis.schema import Schema
from tests.contract.conftest import BACKENDS, redis_store_client
from tests.support.clock import Clock

R1 = ReplicaSpec("r1", "m", events="tcp://127.0.0.1:5557")
R2 = ReplicaSpec("r2", "other", events="tcp://127.0.0.1:5567", dp_size=2)


@dataclass
class Fleet:
    view: RegistryView
    writer: Registry
    """The registry the subscriber writes stream state to (the indexer's)."""
    sync: Callable[[], None]
    """Publish the writer's state and make it visible to ``view`` (no-op in memory)."""
    clock: Clock


@pytest.fixture(params=BACKENDS)
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    clock = Clock()
    backend: str = request.param
    if backend == "memory":
        registry = Registry(stale_after_s=60.0, clock=clock)
        yield Fleet(registry, registry, lambda: None, clock)
        return
    client = redis_store_client(backend, request)
    schema = Schema("test")
    writer = Registry(stale_after_s=60.0, clock=clock)
    fleet_sync = FleetSync(client, schema, writer, clock=clock)
    view = RedisFleetView(client, schema, stale_after_s=60.0, cache_ttl_s=0.0, clock=clock)
    yield Fleet(view, writer, fleet_sync.tick, clock)
    client.close()


def test_add_get_and_list(fleet: Fleet) -> None:
    assert fleet.view.add(R2) is True
    assert fleet.view.add(R1) is True
    assert fleet.view.add(R1) is False
    assert fleet.view.get("r1") == R1
    assert fleet.view.get("nope") is None
    assert fleet.view.replicas() == [R1, R2]
    assert fleet.view.models() == ["m", "other"]


def test_add_changed_spec_updates(fleet: Fleet) -> None:
    fleet.view.add(R1)
    moved = ReplicaSpec("r1", "m", events="tcp://127.0.0.1:6000")
    assert fleet.view.add(moved) is True
    assert fleet.view.get("r1") == moved


def test_remove(fleet: Fleet) -> None:
    fleet.view.add(R1)
    assert fleet.view.remove("r1") == R1
    assert fleet.view.remove("r1") is None
    assert fleet.view.replicas() == []


def test_added_replica_reaches_the_writer(fleet: Fleet) -> None:
    fleet.view.add(R2)
    fleet.sync()
    assert fleet.writer.get("r2") == R2


def test_stream_state_is_visible(fleet: Fleet) -> None:
    fleet.view.add(R1)
    fleet.sync()
    stream = StreamId("r1")
    fleet.writer.record(stream, StreamReport(connected=True, block_size=16, num_decode_errors=1))
    heard = StreamReport(last_seq=7, last_event_ts=fleet.clock.now - 0.5, num_decode_errors=1)
    fleet.writer.record(stream, heard)
    fleet.sync()
    fleet.clock.now += 3.0
    [status] = fleet.view.statuses()
    health = status.health
    assert (status.stream, health.last_seq, health.num_decode_errors) == (stream, 7, 2)
    assert health.connected and health.lag_s == pytest.approx(0.5)
    assert status.silent_s == pytest.approx(3.0)
    assert status.freshness is Freshness.LIVE
    assert fleet.view.stream_ids() == [stream]
    assert [(f.stream, f.freshness) for f in fleet.view.freshness()] == [(stream, Freshness.LIVE)]
    assert fleet.view.block_size("m") == 16
    assert fleet.view.block_size("other") is None


def test_silence_makes_a_stream_stale(fleet: Fleet) -> None:
    fleet.view.add(R1)
    fleet.sync()
    fleet.writer.record(StreamId("r1"), StreamReport(last_seq=1, last_event_ts=fleet.clock.now))
    fleet.sync()
    fleet.clock.now += 61.0
    fleet.sync()
    assert [f.freshness for f in fleet.view.freshness()] == [Freshness.STALE]


def test_removing_a_replica_drops_its_streams(fleet: Fleet) -> None:
    fleet.view.add(R2)
    fleet.sync()
    for rank in (0, 1):
        fleet.writer.record(StreamId("r2", rank), StreamReport(connected=True))
    fleet.sync()
    assert len(fleet.view.statuses()) == 2
    fleet.view.remove("r2")
    assert fleet.view.statuses() == []
    fleet.sync()
    assert fleet.writer.get("r2") is None
    assert fleet.writer.stream_ids() == []


def test_the_streams_version_changes_when_specs_or_streams_do(fleet: Fleet) -> None:
    before = fleet.view.streams_version()
    fleet.view.add(R2)
    assert fleet.view.replicas() == [R2]
    added = fleet.view.streams_version()
    assert added != before
    fleet.sync()
    fleet.writer.record(StreamId("r2", 1), StreamReport(connected=True))
    fleet.sync()
    assert fleet.view.stream_ids() == [StreamId("r2", 1)]
    assert fleet.view.streams_version() != added
    heard = fleet.view.streams_version()
    fleet.view.remove("r2")
    assert fleet.view.streams_version() != heard


POLICY = HealthPolicy(unhealthy_threshold=1, verdict_ttl_s=30.0)


def _fail(record: ReplicaHealth, now: float) -> ReplicaHealth:
    return record.after_check(False, "refused", now, POLICY)


def test_health_records_change_atomically_and_are_read_back(fleet: Fleet) -> None:
    fleet.view.add(R1)
    fleet.view.add(R2)
    assert fleet.view.replica_health() == {}
    now = fleet.clock.now
    updated = fleet.view.update_health({"r1": lambda h: _fail(h, now), "nope": lambda h: h})
    assert list(updated) == ["r1"]  # a replica not in the fleet is not judged
    before, after = updated["r1"]
    assert before == HEALTHY and after.ejection(now, POLICY) is Ejection.HEALTH_CHECK
    assert fleet.view.replica_health() == {"r1": after}
    [(again_before, again)] = fleet.view.update_health({"r1": lambda h: _fail(h, now)}).values()
    assert again_before == after and again.check_failures == 2
    fleet.view.remove("r1")
    assert fleet.view.replica_health() == {}
    fleet.view.add(R1)  # back: judged afresh
    assert fleet.view.replica_health() == {}


def test_health_checks_are_claimed_once_a_round(fleet: Fleet) -> None:
    fleet.view.add(R1)
    fleet.view.add(R2)
    assert fleet.view.claim_health_checks(["r1", "r2"], 1.0) == {"r1", "r2"}
    second = fleet.view.claim_health_checks(["r1", "r2"], 1.0)
    # one process alone on its registry checks everything; on Redis the claims hold
    assert second == ({"r1", "r2"} if isinstance(fleet.view, Registry) else set())


def test_disconnection_is_visible_to_the_scorer(fleet: Fleet) -> None:
    fleet.view.add(R1)
    fleet.sync()
    stream = StreamId("r1")
    fleet.writer.record(stream, StreamReport(connected=True))
    fleet.sync()
    [up] = fleet.view.freshness()
    assert up.connected and up.disconnected_s is None
    fleet.writer.record(stream, StreamReport(connected=False))
    fleet.sync()
    fleet.clock.now += 4.0
    fleet.sync()
    [down] = fleet.view.freshness()
    assert not down.connected and down.disconnected_s == pytest.approx(4.0)


def test_freshness_of_some_streams_and_the_streams_not_connected(fleet: Fleet) -> None:
    """What ``/score`` reads per request: the few streams it explains (in the order asked,
    unknown ones skipped), and the streams whose socket is down."""
    fleet.view.add(R1)
    fleet.view.add(R2)
    fleet.sync()
    up, down, other = StreamId("r1"), StreamId("r2", 0), StreamId("r2", 1)
    fleet.writer.record(up, StreamReport(connected=True))
    fleet.writer.record(down, StreamReport(connected=False))
    fleet.writer.record(other, StreamReport(connected=True))
    fleet.sync()
    everything = {f.stream: f for f in fleet.view.freshness()}
    asked = fleet.view.freshness([other, StreamId("nobody"), up])
    assert asked == [everything[other], everything[up]]
    assert fleet.view.freshness([]) == []
    assert fleet.view.disconnected() == [down]
