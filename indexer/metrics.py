"""The write path's Prometheus series, read from the registry and the index at scrape time;
exported by ``kvindex indexer`` (status port) and ``kvindex serve`` (``/metrics``), not by an
API-only process (the fleet it reads is the indexer's)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvindex import __version__
from kvindex.indexer.domain.events import Tier
from kvindex.indexer.domain.health import UnroutedCounters
from kvindex.indexer.fleet.registry import FleetTotals, RegistryView, StreamStatus, fleet_totals
from kvindex.indexer.index.protocol import BlockIndex

if TYPE_CHECKING:
    from kvindex.indexer.fleet.discovery import DiscoveryCounts

Family = CounterMetricFamily | GaugeMetricFamily


class CounterSeries(NamedTuple):
    name: str
    field: str
    doc: str


COUNTERS: tuple[CounterSeries, ...] = (
    CounterSeries("batches", "num_batches", "Event batches applied"),
    CounterSeries("gaps", "num_gaps", "Sequence gaps seen"),
    CounterSeries("unrepaired_gaps", "num_unrepaired_gaps", "Gaps that replay could not repair"),
    CounterSeries("replays", "num_replays", "Replays requested"),
    CounterSeries("replay_failures", "num_replay_failures", "Replays that timed out or failed"),
    CounterSeries(
        "replay_truncated", "num_replay_truncated", "Replays that began past the seq asked for"
    ),
    CounterSeries("engine_restarts", "num_restarts", "Engine restarts detected (seq reset)"),
    CounterSeries("duplicate_batches", "num_duplicates", "Duplicate batches dropped"),
    CounterSeries("rebuilds", "num_rebuilds", "Streams cleared and rebuilt by a replay from 0"),
    CounterSeries("decode_errors", "num_decode_errors", "Undecodable frames"),
    CounterSeries("bad_events", "num_bad_events", "Events skipped as malformed"),
    CounterSeries("store_errors", "num_store_errors", "Index store failures while ingesting"),
    CounterSeries("orphan_stores", "num_orphan_stores", "Stores whose parent block was unknown"),
    CounterSeries("unknown_removals", "num_unknown_removals", "Removals of blocks not held"),
    CounterSeries(
        "misaligned_events",
        "num_misaligned_events",
        "Stores whose tokens do not fill their blocks exactly (dropped)",
    ),
    CounterSeries(
        "history_lost",
        "num_history_lost",
        "Streams cleared because a gap could not be repaired (rebuilt from later events)",
    ),
    CounterSeries(
        "store_refills",
        "num_store_refills",
        "Streams rebuilt by replay because the index store lost its data",
    ),
    CounterSeries("probes", "num_probes", "Seq-reset probes of silent streams"),
)
"""Every ``StreamCounters`` field as ``kvindex_<name>_total`` (a test checks none is left)."""

_STREAM_LABELS = ["replica", "rank", "model"]


class IngestCollector(Collector):
    """Reads the write path's counters and gauges at scrape time. Never fails a scrape: a
    store ``store_up`` (cached, non-blocking) says is down is not read, and an index read
    that fails ends the scrape's reads."""

    def __init__(
        self,
        registry: RegistryView,
        index: BlockIndex,
        *,
        store_up: Callable[[], bool] | None = None,
    ) -> None:
        self._registry = registry
        self._index = index
        self._store_up = store_up

    def collect(self) -> Iterator[Family]:
        statuses = self._registry.statuses()
        model_of = {spec.id: spec.model for spec in self._registry.replicas()}
        labelled = [(status, _labels(status, model_of)) for status in statuses]
        yield from _counters(labelled)
        yield from _stream_gauges(labelled)
        yield _partial(labelled)
        yield from _fleet(fleet_totals(self._registry, statuses=statuses))
        yield self._blocks(labelled)

    def _blocks(self, labelled: Iterable[tuple[StreamStatus, list[str]]]) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(
            "kvindex_blocks", "Blocks held in the index", labels=[*_STREAM_LABELS, "tier"]
        )
        if self._store_up is not None and not self._store_up():
            return gauge
        try:
            for status, labels in labelled:
                stats = self._index.stats(status.stream)
                for tier in Tier:
                    count = stats.blocks_by_tier.get(tier, 0)
                    gauge.add_metric([*labels, tier.name.lower()], count)
        except Exception:  # the store is down: report what we have, never fail a scrape
            pass
        return gauge


Labelled = Sequence[tuple[StreamStatus, list[str]]]


def _labels(status: StreamStatus, model_of: dict[str, str]) -> list[str]:
    stream = status.stream
    return [stream.replica, str(stream.rank), model_of.get(stream.replica, "")]


def _counters(labelled: Labelled) -> Iterator[CounterMetricFamily]:
    for series in COUNTERS:
        family = CounterMetricFamily(f"kvindex_{series.name}", series.doc, labels=_STREAM_LABELS)
        for status, labels in labelled:
            family.add_metric(labels, getattr(status.health, series.field))
        yield family


def _stream_gauges(labelled: Labelled) -> Iterator[GaugeMetricFamily]:
    lag = _gauge("lag_seconds", "Receive time minus engine time of the last applied batch")
    silent = _gauge("silent_seconds", "Seconds since the stream was last heard")
    connected = _gauge("connected", "1 while the stream's socket is connected")
    block_size = _gauge("block_size", "Tokens per block in the stream's events")
    for status, labels in labelled:
        health = status.health
        if health.lag_s is not None:
            lag.add_metric(labels, health.lag_s)
        if status.silent_s is not None:
            silent.add_metric(labels, status.silent_s)
        connected.add_metric(labels, 1 if health.connected else 0)
        if health.block_size:
            block_size.add_metric(labels, health.block_size)
    yield from (lag, silent, connected, block_size)


def _partial(labelled: Labelled) -> GaugeMetricFamily:
    """The start time of each partial view, by reason; a whole one has no series."""
    gauge = GaugeMetricFamily(
        "kvindex_stream_partial_since_seconds",
        "Unix time since which the stream's view is partial (blocks the replica holds may be"
        " unknown), by reason",
        labels=[*_STREAM_LABELS, "reason"],
    )
    for status, labels in labelled:
        health = status.health
        if health.partial is not None:
            gauge.add_metric([*labels, health.partial], health.partial_since or 0.0)
    return gauge


def _gauge(name: str, doc: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"kvindex_stream_{name}", doc, labels=_STREAM_LABELS)


def _fleet(totals: FleetTotals) -> Iterator[Family]:
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


class BuildInfo(Collector):
    """``kvindex_build_info{version, component}``, always 1: which build this process runs
    (``component``: indexer, api or proxy). Every kvindex process registers one."""

    def __init__(self, component: str, *, version: str = __version__) -> None:
        self._component = component
        self._version = version

    def collect(self) -> Iterator[GaugeMetricFamily]:
        info = GaugeMetricFamily(
            "kvindex_build_info", "The running kvindex build", labels=["version", "component"]
        )
        info.add_metric([self._version, self._component], 1)
        yield info


class IndexerProcessCollector(Collector):
    """The indexer process's own series: its store's state (``store_up`` must not block),
    its build, and what discovery has done (zeros without discovery)."""

    def __init__(
        self,
        store_up: Callable[[], bool],
        *,
        version: str = __version__,
        discovered: Callable[[], DiscoveryCounts | None] = lambda: None,
    ) -> None:
        self._store_up = store_up
        self._build = BuildInfo("indexer", version=version)
        self._discovered = discovered

    def collect(self) -> Iterator[Family]:
        yield GaugeMetricFamily(
            "kvindex_indexer_store_up",
            "1 when the indexer's last probe of its index store succeeded, else 0",
            value=1 if self._store_up() else 0,
        )
        yield from self._build.collect()
        yield from _discovery(self._discovered())


_DISCOVERY_COUNTERS = (
    ("lists", "Pod lists from the Kubernetes API (the first, then after a 410)"),
    ("api_errors", "Kubernetes API calls that failed (backed off)"),
    ("skipped_pods", "Pods that make no replica (no model, bad port)"),
    ("write_errors", "Fleet changes that failed (retried each second)"),
)


def _discovery(counts: DiscoveryCounts | None) -> Iterator[Family]:
    """Zeros without discovery (None)."""
    yield GaugeMetricFamily(
        "kvindex_discovery_replicas",
        "Replicas this process's discovery keeps registered (the Ready pods' ports)",
        value=0 if counts is None else counts.replicas,
    )
    for name, doc in _DISCOVERY_COUNTERS:
        value = 0 if counts is None else getattr(counts, name)
        yield CounterMetricFamily(f"kvindex_discovery_{name}", doc, value=value)
