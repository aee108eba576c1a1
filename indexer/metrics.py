"""The write path's Prometheus series, read from the registry and the index at scrape time.

:class:`IngestCollector` is a custom collector: nothing is counted twice, the pipeline never
imports metrics code, and a scrape reads each stream's record whole. A process exports it
once for the write path it runs (the indexer's status port; ``kvindex serve``'s /metrics).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvindex.indexer.events import StreamId, Tier
from kvindex.indexer.fleet.registry import FleetTotals, RegistryView, fleet_totals
from kvindex.indexer.health import StreamCounters, UnroutedCounters
from kvindex.indexer.index.protocol import BlockIndex

_Counter = tuple[str, str, Callable[[StreamCounters], int]]
_COUNTERS: tuple[_Counter, ...] = (
    ("batches", "Event batches applied", lambda c: c.num_batches),
    ("gaps", "Sequence gaps seen", lambda c: c.num_gaps),
    ("unrepaired_gaps", "Gaps that replay could not repair", lambda c: c.num_unrepaired_gaps),
    ("replays", "Replays requested", lambda c: c.num_replays),
    ("replay_failures", "Replays that timed out or failed", lambda c: c.num_replay_failures),
    ("engine_restarts", "Engine restarts detected (seq reset)", lambda c: c.num_restarts),
    ("duplicate_batches", "Duplicate batches dropped", lambda c: c.num_duplicates),
    ("decode_errors", "Undecodable frames", lambda c: c.num_decode_errors),
    ("bad_events", "Events skipped as malformed", lambda c: c.num_bad_events),
    ("store_errors", "Index store failures while ingesting", lambda c: c.num_store_errors),
    ("orphan_stores", "Stores whose parent block was unknown", lambda c: c.num_orphan_stores),
    ("unknown_removals", "Removals of blocks not held", lambda c: c.num_unknown_removals),
)
"""Per-stream counters ``kvindex_<name>``: name, help, and where the stream's record holds it."""


class IngestCollector(Collector):
    """Reads the write path's counters when Prometheus scrapes."""

    def __init__(self, registry: RegistryView, index: BlockIndex) -> None:
        self._registry = registry
        self._index = index

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        statuses = self._registry.statuses()
        for name, doc, value_of in _COUNTERS:
            family = CounterMetricFamily(f"kvindex_{name}", doc, labels=["replica", "rank"])
            for status in statuses:
                labels = [status.stream.replica, str(status.stream.rank)]
                family.add_metric(labels, value_of(status.health))
            yield family
        yield from _fleet(fleet_totals(self._registry, statuses=statuses))
        yield self._blocks(s.stream for s in statuses)

    def _blocks(self, streams: Iterable[StreamId]) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(
            "kvindex_blocks", "Blocks held in the index", labels=["replica", "rank", "tier"]
        )
        try:
            for stream in streams:
                stats = self._index.stats(stream)
                for tier in Tier:
                    labels = [stream.replica, str(stream.rank), tier.name.lower()]
                    gauge.add_metric(labels, stats.blocks_by_tier.get(tier, 0))
        except Exception:  # the store is down: report what we have, never fail a scrape
            pass
        return gauge


def _fleet(totals: FleetTotals) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    yield GaugeMetricFamily("kvindex_replicas", "Replicas registered", value=totals.num_replicas)
    streams = GaugeMetricFamily("kvindex_streams", "Streams by freshness", labels=["state"])
    for freshness, count in totals.num_streams_by_freshness.items():
        streams.add_metric([freshness.value], count)
    yield streams
    yield _unrouted(totals.unrouted)


def _unrouted(unrouted: UnroutedCounters) -> CounterMetricFamily:
    family = CounterMetricFamily(
        "kvindex_unrouted_frames",
        "Frames of the bound SUB that reached no stream, by reason",
        labels=["reason"],
    )
    family.add_metric(["undecodable"], unrouted.num_undecodable)
    family.add_metric(["unidentified"], unrouted.num_unidentified)
    family.add_metric(["refused"], unrouted.num_refused)
    return family
