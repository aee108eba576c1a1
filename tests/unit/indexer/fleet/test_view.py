"""kvindex.indexer.fleet.view: replica health updates on fakeredis (the rest of the view's
contract: tests/contract/test_registry_view_contract.py)."""

from __future__ import annotations

import fakeredis
import pytest

from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.fleet.registry import DiscoveryLedger, Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.fleet.replica_health import HealthPolicy, ReplicaHealth
from kvindex.indexer.fleet.sync import FleetSync
from kvindex.indexer.fleet.view import RedisFleetView
from kvindex.indexer.index.protocol import IndexUnavailableError
from kvindex.indexer.redis.schema import Schema

SCHEMA = Schema("t")
NOW = 1_000_000.0
POLICY = HealthPolicy()


SERVER = fakeredis.FakeServer()


def _views() -> tuple[RedisFleetView, RedisFleetView]:
    """Two processes' views of one fleet (r1 in it), on a Redis of their own."""
    fakeredis.FakeRedis(server=SERVER).flushall()
    first, second = (
        RedisFleetView(fakeredis.FakeRedis(server=SERVER), SCHEMA, cache_ttl_s=0.0)
        for _ in range(2)
    )
    first.add(ReplicaSpec("r1", "m"))
    return first, second


def _failed(record: ReplicaHealth) -> ReplicaHealth:
    return record.after_check(False, "down", 1.0, POLICY)


def test_a_change_raced_by_another_writer_is_applied_on_the_new_record() -> None:
    first, second = _views()
    calls: list[ReplicaHealth] = []

    def change(record: ReplicaHealth) -> ReplicaHealth:
        calls.append(record)
        if len(calls) == 1:  # another process writes between our read and our write
            second.update_health({"r1": lambda h: h.breaker_opened(1.0, POLICY, "status 502")})
        return _failed(record)

    [(before, after)] = first.update_health({"r1": change}).values()
    assert len(calls) == 2 and before.breaker_open_until is not None
    stored = second.replica_health()["r1"]
    assert stored == after and stored.check_failures == 1 and stored.breaker_open_until == 11.0


def test_a_writer_that_always_races_gives_up_with_a_named_error() -> None:
    first, second = _views()

    def change(record: ReplicaHealth) -> ReplicaHealth:
        second.update_health({"r1": _failed})
        return record

    with pytest.raises(IndexUnavailableError, match="too many concurrent writers"):
        first.update_health({"r1": change})


def test_an_undecodable_record_reads_as_healthy() -> None:
    first, _ = _views()
    fakeredis.FakeRedis(server=SERVER).hset(SCHEMA.replica_health, "r1", b"{not json")
    assert first.replica_health() == {"r1": ReplicaHealth()}
    [(before, _)] = first.update_health({"r1": _failed}).values()
    assert before == ReplicaHealth()


def test_the_streams_version_stays_while_refreshes_read_the_same_fleet() -> None:
    """A refresh that reads the same specs and streams keeps the version (the API keeps the
    stream list it made for it); another spec or stream moves it; the streams down are
    the snapshot's."""
    client = fakeredis.FakeRedis(server=SERVER)
    client.flushall()
    registry = Registry(clock=lambda: NOW)
    registry.record(StreamId("r1"), StreamReport(connected=True, last_event_ts=NOW))
    sync = FleetSync(client, SCHEMA, registry, clock=lambda: NOW)
    sync.tick()
    view = RedisFleetView(
        fakeredis.FakeRedis(server=SERVER), SCHEMA, cache_ttl_s=0.0, clock=lambda: NOW
    )
    view.add(ReplicaSpec("r1", "m"))
    first = view.streams_version()
    assert [view.streams_version() for _ in range(3)] == [first] * 3
    assert view.disconnected() == []
    registry.record(StreamId("r1", 1), StreamReport(connected=False))
    sync.tick()
    second = view.streams_version()
    assert second != first
    assert view.streams_version() == second
    assert view.disconnected() == [StreamId("r1", 1)]
    view.add(ReplicaSpec("r2", "m"))
    assert view.streams_version() != second


def test_the_discovery_ledger_is_shared_and_kept_per_source() -> None:
    first, second = _views()
    assert isinstance(first, DiscoveryLedger)
    first.mark_discovered("r1", "ns/pool/a")
    first.mark_discovered("r2", "ns/pool/b")
    assert second.discovered("ns/pool/a") == {"r1"} and second.discovered("ns/pool/b") == {"r2"}
    second.unmark_discovered("r1")
    second.unmark_discovered("never")
    assert first.discovered("ns/pool/a") == set() and first.discovered("ns/pool/b") == {"r2"}
    assert not isinstance(Registry(), DiscoveryLedger)  # in process: nothing outlives it
