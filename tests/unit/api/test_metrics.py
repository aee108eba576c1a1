"""/metrics: every write-path counter read from the stream's record, and the fleet gauges."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvindex.api.metrics import ApiMetrics
from kvindex.indexer.events import StreamId
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.health import StreamReport, UnroutedCounters
from kvindex.indexer.index.memory import MemoryIndex

COUNTER_NAMES = {
    "kvindex_batches": "num_batches",
    "kvindex_gaps": "num_gaps",
    "kvindex_unrepaired_gaps": "num_unrepaired_gaps",
    "kvindex_replays": "num_replays",
    "kvindex_replay_failures": "num_replay_failures",
    "kvindex_engine_restarts": "num_restarts",
    "kvindex_duplicate_batches": "num_duplicates",
    "kvindex_decode_errors": "num_decode_errors",
    "kvindex_bad_events": "num_bad_events",
    "kvindex_store_errors": "num_store_errors",
    "kvindex_orphan_stores": "num_orphan_stores",
    "kvindex_unknown_removals": "num_unknown_removals",
}


def samples(metrics: ApiMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


def test_each_counter_of_a_stream_is_exported_under_its_name() -> None:
    registry = Registry((ReplicaSpec("r1", "m"),))
    stream = StreamId("r1")
    amounts = {attr: i + 1 for i, attr in enumerate(COUNTER_NAMES.values())}
    registry.record(stream, StreamReport(**amounts))  # type: ignore[arg-type]
    found = samples(ApiMetrics(registry, MemoryIndex()))
    labels = (("rank", "0"), ("replica", "r1"))
    for name, attr in COUNTER_NAMES.items():
        assert found[(name + "_total", labels)] == amounts[attr], name


def test_fleet_gauges_count_replicas_and_streams_by_freshness() -> None:
    registry = Registry((ReplicaSpec("r1", "m"), ReplicaSpec("r2", "m")))
    registry.record(StreamId("r1"), StreamReport(connected=True))
    registry.record(StreamId("r2"), StreamReport(replaying=True))
    found = samples(ApiMetrics(registry, MemoryIndex()))
    assert found[("kvindex_replicas", ())] == 2
    states = {
        state: found[("kvindex_streams", (("state", state),))]
        for state in ("live", "replaying", "stale")
    }
    assert states == {"live": 1, "replaying": 1, "stale": 0}


def test_frames_of_the_bound_sub_that_reach_no_stream_are_exported_by_reason() -> None:
    registry = Registry()
    registry.record_unrouted(UnroutedCounters(num_undecodable=3, num_refused=2))
    found = samples(ApiMetrics(registry, MemoryIndex()))
    by_reason = {
        reason: found[("kvindex_unrouted_frames_total", (("reason", reason),))]
        for reason in ("undecodable", "unidentified", "refused")
    }
    assert by_reason == {"undecodable": 3, "unidentified": 0, "refused": 2}
