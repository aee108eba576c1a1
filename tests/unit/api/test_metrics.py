"""/metrics: every write-path counter read from the stream's record, and the fleet gauges."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

import kvindex
from kvindex.api.block_sizes import BlockSizeCheck
from kvindex.api.metrics import ApiMetrics
from kvindex.api.settings import ApiSettings
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


# --- what an API process exports of its own, and what it leaves to the indexer ----------

WRITE_PATH_SERIES = ("kvindex_batches_total", "kvindex_blocks", "kvindex_replicas")


def names(metrics: ApiMetrics) -> set[str]:
    return {name for name, _ in samples(metrics)}


def test_an_api_only_process_leaves_the_fleet_series_to_the_indexer() -> None:
    """Each API pod exporting the fleet's counters makes sum() count them once per pod."""
    registry = Registry((ReplicaSpec("r1", "m"),))
    registry.record(StreamId("r1"), StreamReport(num_batches=5))
    api_only = names(ApiMetrics(registry, MemoryIndex(), runs_write_path=False))
    with_indexer = names(ApiMetrics(registry, MemoryIndex(), runs_write_path=True))
    for series in WRITE_PATH_SERIES:
        assert series not in api_only, series
        assert series in with_indexer, series


def test_store_up_follows_the_circuit_and_build_info_names_the_version() -> None:
    registry = Registry(())
    up = [True]
    metrics = ApiMetrics(registry, MemoryIndex(), store_up=lambda: up[0])
    assert samples(metrics)[("kvindex_api_store_up", ())] == 1
    up[0] = False
    assert samples(metrics)[("kvindex_api_store_up", ())] == 0
    build = (("component", "api"), ("version", kvindex.__version__))
    assert samples(metrics)[("kvindex_build_info", build)] == 1


def test_degraded_reasons_are_exported_from_zero() -> None:
    metrics = ApiMetrics(Registry(()), MemoryIndex())
    metrics.degraded_answers.labels("fleet_unreadable").inc()
    found = samples(metrics)
    assert found[("kvindex_degraded_answers_total", (("reason", "index_unavailable"),))] == 0
    assert found[("kvindex_degraded_answers_total", (("reason", "fleet_unreadable"),))] == 1


def test_block_size_mismatches_are_counted_per_model() -> None:
    registry = Registry(
        (ReplicaSpec("a", "m"), ReplicaSpec("b", "m"), ReplicaSpec("c", "m"), ReplicaSpec("d", "n"))
    )
    for replica, size in (("a", 16), ("b", 16), ("c", 32), ("d", 16)):
        registry.record(StreamId(replica), StreamReport(block_size=size))
    check = BlockSizeCheck(ApiSettings(), registry)
    found = samples(ApiMetrics(registry, MemoryIndex(), block_sizes=check))
    assert found[("kvindex_block_size_mismatch_streams", (("model", "m"),))] == 1
    assert found[("kvindex_block_size_mismatch_streams", (("model", "n"),))] == 0
