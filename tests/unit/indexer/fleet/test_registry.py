"""Registry specifics: records folded from reports, snapshots that do not move, totals."""

from __future__ import annotations

import random

from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.fleet.registry import (
    Freshness,
    Registry,
    StreamFreshness,
    fleet_totals,
    freshness_of,
    stream_freshness,
)
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import OpKind
from tests.support.clock import Clock

A0, A1, B0 = StreamId("a", 0), StreamId("a", 1), StreamId("b", 0)


def test_a_status_holds_a_copy_of_the_record() -> None:
    registry = Registry((ReplicaSpec("a", "m", dp_size=2),))
    registry.record(A0, StreamReport(num_gaps=1))
    status = registry.status(A0)
    assert status is not None
    registry.record(A0, StreamReport(num_gaps=1))
    assert status.health.num_gaps == 1
    assert registry.status(A1) is None


def test_a_disconnected_stream_is_stale_and_counts_its_time_away() -> None:
    clock = Clock()
    registry = Registry(clock=clock)
    registry.record(A0, StreamReport(connected=True))
    assert registry.disconnected_for(A0) is None
    registry.record(A0, StreamReport(connected=False))
    clock.now += 30.0
    assert registry.disconnected_for(A0) == 30.0
    assert [f.freshness for f in registry.freshness()] == [Freshness.STALE]


def test_a_stream_never_connected_nor_heard_from_is_stale_until_it_is() -> None:
    clock = Clock()
    registry = Registry(clock=clock)
    registry.record(A0, StreamReport())  # tracked; its endpoint never answered
    registry.record(B0, StreamReport())
    assert [f.freshness for f in registry.freshness()] == [Freshness.STALE] * 2
    registry.record(A0, StreamReport(connected=True))  # connect mode: the monitor says so
    registry.record(B0, StreamReport(last_seq=0, last_event_ts=clock.now))  # bind mode
    assert [f.freshness for f in registry.freshness()] == [Freshness.LIVE] * 2


def test_fleet_totals_add_up_every_stream_and_its_blocks() -> None:
    registry = Registry((ReplicaSpec("a", "m", dp_size=2), ReplicaSpec("b", "m")))
    index = MemoryIndex()
    index.apply(A0, 0, 1.0, [(OpKind.STORE, Tier.GPU, 1, 11), (OpKind.STORE, Tier.GPU, 2, 12)])
    index.apply(B0, 0, 1.0, [(OpKind.STORE, Tier.CPU, 3, 13)])
    registry.record(A0, StreamReport(num_batches=2, num_decode_errors=1, connected=True))
    registry.record(A1, StreamReport(num_batches=3, replaying=True))
    registry.record(B0, StreamReport(num_batches=4, connected=True))
    totals = fleet_totals(registry, index)
    assert (totals.num_replicas, totals.num_streams) == (2, 3)
    assert (totals.counters.num_batches, totals.counters.num_decode_errors) == (9, 1)
    assert totals.blocks_by_tier == {Tier.GPU: 2, Tier.CPU: 1, Tier.OTHER: 0}
    by_freshness = totals.num_streams_by_freshness
    assert by_freshness == {
        Freshness.LIVE: 2,
        Freshness.PARTIAL: 0,
        Freshness.REPLAYING: 1,
        Freshness.STALE: 0,
        Freshness.ORPHANED: 0,
    }


def test_fleet_totals_without_an_index_leave_blocks_out() -> None:
    registry = Registry()
    assert fleet_totals(registry).blocks_by_tier == {}
    assert fleet_totals(registry).num_streams == 0


def test_the_block_size_follows_streams_specs_and_sizes_though_remembered() -> None:
    registry = Registry((ReplicaSpec("a", "m", dp_size=2), ReplicaSpec("b", "m")))
    assert registry.block_size("m") is None
    registry.record(A0, StreamReport(block_size=16))
    assert registry.block_size("m") == 16
    registry.record(A1, StreamReport(block_size=32))
    registry.record(B0, StreamReport(block_size=32))
    assert registry.block_size("m") == 32  # the most common
    registry.record(B0, StreamReport(num_gaps=1))  # no size: the same
    assert registry.block_size("m") == 32
    registry.forget(B0)
    assert registry.block_size("m") in {16, 32}
    registry.remove("a")
    assert registry.block_size("m") is None
    registry.add(ReplicaSpec("a", "other"))
    registry.record(A0, StreamReport(block_size=64))
    assert (registry.block_size("m"), registry.block_size("other")) == (None, 64)
    registry.add(ReplicaSpec("a", "m"))  # the replica changes model
    assert (registry.block_size("m"), registry.block_size("other")) == (64, None)


def test_the_streams_version_moves_with_the_specs_and_the_streams_heard_of() -> None:
    registry = Registry((ReplicaSpec("a", "m", dp_size=2),))
    seen = [registry.streams_version()]

    def moved() -> bool:
        seen.append(registry.streams_version())
        return seen[-1] != seen[-2]

    registry.record(A0, StreamReport(last_seq=1))
    assert moved()  # a new stream
    registry.record(A0, StreamReport(last_seq=2))
    assert not moved()  # the same streams: what the scorer made of them holds
    registry.add(ReplicaSpec("b", "m"))
    assert moved()
    registry.add(ReplicaSpec("b", "m"))
    assert not moved()  # the same spec
    registry.forget(A0)
    assert moved()
    registry.forget(A0)
    assert not moved()
    registry.remove("b")
    assert moved()


def test_the_streams_down_are_kept_as_records_change() -> None:
    registry = Registry((ReplicaSpec("a", "m", dp_size=2), ReplicaSpec("b", "m")))
    for stream in (B0, A1, A0):
        registry.record(stream, StreamReport(connected=True))
    assert registry.disconnected() == []
    registry.record(B0, StreamReport(connected=False))
    registry.record(A0, StreamReport(connected=False))
    assert registry.disconnected() == [A0, B0]  # sorted
    registry.record(A0, StreamReport(last_seq=3))  # no news of the socket: still down
    assert registry.disconnected() == [A0, B0]
    registry.record(A0, StreamReport(connected=True))
    assert registry.disconnected() == [B0]
    registry.forget(B0)
    registry.record(A1, StreamReport(connected=False))
    assert registry.disconnected() == [A1]
    registry.remove("a")
    assert registry.disconnected() == []


def test_freshness_equals_its_reference() -> None:
    """``Registry.freshness`` (inlined) equals ``freshness_of`` + ``stream_freshness`` per
    stream, over random records and clock moves (silent, stale, replaying, partial, down)."""
    rng = random.Random(7)
    clock = Clock()
    registry = Registry(stale_after_s=30.0, clock=clock)
    streams = [StreamId(f"r{i}", rank) for i in range(12) for rank in range(2)]
    for _ in range(400):
        stream = rng.choice(streams)
        report = StreamReport(
            last_seq=rng.choice([None, rng.randrange(100)]),
            last_event_ts=clock.now - rng.random(),
            replaying=rng.choice([None, True, False]),
            connected=rng.choice([None, None, True, False]),
            partial=rng.choice([None, None, "", "gap"]),
        )
        registry.record(stream, report)
        clock.now += rng.choice([0.0, 0.5, 20.0, 45.0])
        asked = [*rng.sample(streams, 5), StreamId("nobody")]
        now, records = clock.now, registry.records()
        for got in (registry.freshness(), registry.freshness(asked)):
            want = []
            for view in got:
                health = records[view.stream]
                heard = health.last_heard
                silent = None if heard is None else now - heard
                fresh = freshness_of(health, silent, 30.0)
                want.append(stream_freshness(view.stream, health, fresh, silent, now))
            assert got == want
            assert all(type(view) is StreamFreshness for view in got)
        assert [v.stream for v in registry.freshness(asked)] == [s for s in asked if s in records]
