"""The write path's series: every counter of a stream's record, the per-stream gauges, the
fleet gauges, and the indexer process's own series, read from a real registry and index."""

from __future__ import annotations

from dataclasses import fields

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvindex import __version__
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.domain.health import StreamCounters, StreamReport, UnroutedCounters
from kvindex.indexer.fleet.discovery import DiscoveryCounts
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import OpKind, StreamStats
from kvindex.indexer.metrics import COUNTERS, IndexerProcessCollector, IngestCollector
from tests.support.clock import Clock

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
R1 = (("model", "m"), ("rank", "0"), ("replica", "r1"))

EXPECTED_COUNTERS = {
    "kvindex_batches_total": "num_batches",
    "kvindex_gaps_total": "num_gaps",
    "kvindex_unrepaired_gaps_total": "num_unrepaired_gaps",
    "kvindex_replays_total": "num_replays",
    "kvindex_replay_failures_total": "num_replay_failures",
    "kvindex_replay_truncated_total": "num_replay_truncated",
    "kvindex_engine_restarts_total": "num_restarts",
    "kvindex_duplicate_batches_total": "num_duplicates",
    "kvindex_rebuilds_total": "num_rebuilds",
    "kvindex_decode_errors_total": "num_decode_errors",
    "kvindex_bad_events_total": "num_bad_events",
    "kvindex_store_errors_total": "num_store_errors",
    "kvindex_orphan_stores_total": "num_orphan_stores",
    "kvindex_unknown_removals_total": "num_unknown_removals",
    "kvindex_misaligned_events_total": "num_misaligned_events",
    "kvindex_history_lost_total": "num_history_lost",
    "kvindex_store_refills_total": "num_store_refills",
    "kvindex_probes_total": "num_probes",
}
"""The names dashboards and alert rules use: renaming one is a breaking change."""


def samples(*collectors: IngestCollector | IndexerProcessCollector) -> Samples:
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }


def names(found: Samples, name: str) -> list[tuple[tuple[str, str], ...]]:
    return [labels for (n, labels) in found if n == name]


def test_every_counter_of_a_stream_record_has_a_series() -> None:
    exported = {series.field for series in COUNTERS}
    assert exported == {f.name for f in fields(StreamCounters)}
    assert len({series.name for series in COUNTERS}) == len(COUNTERS)


def test_each_counter_of_a_stream_is_exported_under_its_name_with_its_model() -> None:
    registry = Registry((ReplicaSpec("r1", "m"),))
    amounts = {f.name: i + 1 for i, f in enumerate(fields(StreamCounters))}
    report = StreamReport()
    report.add(StreamCounters(**amounts))
    registry.record(StreamId("r1"), report)
    found = samples(IngestCollector(registry, MemoryIndex()))
    for name, attr in EXPECTED_COUNTERS.items():
        assert found[(name, R1)] == amounts[attr], name
    assert set(EXPECTED_COUNTERS.values()) == set(amounts)


def test_stream_gauges_have_a_sample_only_when_known() -> None:
    clock = Clock()
    registry = Registry((ReplicaSpec("r1", "m"), ReplicaSpec("r2", "m2")), clock=clock)
    registry.record(
        StreamId("r1"),
        StreamReport(connected=True, last_seq=4, last_event_ts=clock.now - 0.5, block_size=16),
    )
    registry.record(StreamId("r2", 1), StreamReport(connected=False))
    clock.now += 2.0
    found = samples(IngestCollector(registry, MemoryIndex()))
    r2 = (("model", "m2"), ("rank", "1"), ("replica", "r2"))
    assert found[("kvindex_stream_lag_seconds", R1)] == 0.5
    assert found[("kvindex_stream_silent_seconds", R1)] == 2.0
    assert found[("kvindex_stream_block_size", R1)] == 16
    assert found[("kvindex_stream_connected", R1)] == 1
    assert found[("kvindex_stream_connected", r2)] == 0
    for name in ("lag_seconds", "silent_seconds", "block_size"):
        assert names(found, f"kvindex_stream_{name}") == [R1], name


def _index_with_blocks() -> MemoryIndex:
    index = MemoryIndex()
    ops = [(OpKind.STORE, Tier.GPU, 1, 101), (OpKind.STORE, Tier.CPU, 2, 102)]
    index.apply(StreamId("r1"), 0, 1.0, ops)
    return index


def test_blocks_by_tier_carry_the_model() -> None:
    registry = Registry((ReplicaSpec("r1", "m"),))
    registry.record(StreamId("r1"), StreamReport(connected=True))
    found = samples(IngestCollector(registry, _index_with_blocks()))
    assert found[("kvindex_blocks", (*R1, ("tier", "gpu")))] == 1
    assert found[("kvindex_blocks", (*R1, ("tier", "cpu")))] == 1
    assert found[("kvindex_blocks", (*R1, ("tier", "other")))] == 0


class _UnreadableIndex(MemoryIndex):
    """An index a scrape must not read (a store the probe says is down)."""

    num_reads = 0

    def stats(self, stream: StreamId) -> StreamStats:
        self.num_reads += 1
        raise AssertionError("read while the store is down")


def test_a_store_down_is_not_read_and_the_scrape_still_answers() -> None:
    registry = Registry((ReplicaSpec("r1", "m"),))
    registry.record(StreamId("r1"), StreamReport(num_batches=3))
    index = _UnreadableIndex()
    found = samples(IngestCollector(registry, index, store_up=lambda: False))
    assert names(found, "kvindex_blocks") == []
    assert index.num_reads == 0
    assert found[("kvindex_batches_total", R1)] == 3


def test_fleet_gauges_count_replicas_and_streams_by_freshness() -> None:
    registry = Registry((ReplicaSpec("r1", "m"), ReplicaSpec("r2", "m")))
    registry.record(StreamId("r1"), StreamReport(connected=True))
    registry.record(StreamId("r2"), StreamReport(replaying=True))
    found = samples(IngestCollector(registry, MemoryIndex()))
    assert found[("kvindex_replicas", ())] == 2
    states = {
        state: found[("kvindex_streams", (("state", state),))]
        for state in ("live", "replaying", "stale")
    }
    assert states == {"live": 1, "replaying": 1, "stale": 0}


def test_frames_of_the_bound_sub_that_reach_no_stream_are_exported_by_reason() -> None:
    registry = Registry()
    registry.record_unrouted(UnroutedCounters(num_undecodable=3, num_refused=2))
    found = samples(IngestCollector(registry, MemoryIndex()))
    by_reason = {
        reason: found[("kvindex_unrouted_frames_total", (("reason", reason),))]
        for reason in ("undecodable", "unidentified", "refused")
    }
    assert by_reason == {"undecodable": 3, "unidentified": 0, "refused": 2}


def test_the_indexer_process_reports_its_store_and_its_build() -> None:
    up = [True]
    collector = IndexerProcessCollector(lambda: up[0])
    build = (("component", "indexer"), ("version", __version__))
    assert samples(collector)[("kvindex_build_info", build)] == 1
    assert samples(collector)[("kvindex_indexer_store_up", ())] == 1
    up[0] = False
    assert samples(collector)[("kvindex_indexer_store_up", ())] == 0


def test_the_indexer_reports_discovery_zeros_without_it_and_its_counts_with_it() -> None:
    found = samples(IndexerProcessCollector(lambda: True))
    assert found[("kvindex_discovery_replicas", ())] == 0
    assert found[("kvindex_discovery_lists_total", ())] == 0
    counts = DiscoveryCounts(replicas=4, skipped_pods=1, write_errors=2, api_errors=3, lists=5)
    found = samples(IndexerProcessCollector(lambda: True, discovered=lambda: counts))
    assert [
        found[(f"kvindex_discovery_{name}", ())]
        for name in ("replicas", "skipped_pods_total", "write_errors_total", "api_errors_total")
    ] == [4, 1, 2, 3]
    assert found[("kvindex_discovery_lists_total", ())] == 5
