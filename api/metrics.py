"""Prometheus metrics of one API process: a per-app registry, never the global one.

The write path's series come from :class:`~kvindex.indexer.metrics.IngestCollector` (read
at scrape time); lookups are timed by a wrapper that implements the same BlockIndex Protocol.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kvindex.indexer.events import StreamId
from kvindex.indexer.fleet.registry import RegistryView
from kvindex.indexer.index.protocol import (
    ApplyResult,
    BatchOps,
    BlockIndex,
    Op,
    PrefixMatch,
    StreamStats,
)
from kvindex.indexer.metrics import IngestCollector

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class ApiMetrics:
    """Everything /metrics exposes for one app."""

    def __init__(self, registry: RegistryView, index: BlockIndex) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.score_latency = Histogram(
            "kvindex_score_seconds",
            "Time to answer POST /score",
            ["policy"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.lookup_latency = Histogram(
            "kvindex_lookup_seconds",
            "Time of one index longest-prefix lookup",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(IngestCollector(registry, index))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TimedIndex:
    """A BlockIndex that times lookups; everything else passes through."""

    def __init__(self, inner: BlockIndex, histogram: Histogram) -> None:
        self._inner = inner
        self._histogram = histogram

    def apply(self, stream: StreamId, seq: int, ts: float, ops: Sequence[Op]) -> ApplyResult:
        return self._inner.apply(stream, seq, ts, ops)

    def apply_many(self, stream: StreamId, batches: Sequence[BatchOps]) -> list[ApplyResult]:
        return self._inner.apply_many(stream, batches)

    def resolve(self, stream: StreamId, engine_hashes: Sequence[int]) -> list[int | None]:
        return self._inner.resolve(stream, engine_hashes)

    def clear(self, stream: StreamId) -> None:
        self._inner.clear(stream)

    def drop(self, stream: StreamId) -> None:
        self._inner.drop(stream)

    def streams(self) -> list[StreamId]:
        return self._inner.streams()

    def longest_prefix(
        self, keys: Sequence[int], streams: Iterable[StreamId]
    ) -> dict[StreamId, PrefixMatch]:
        started = time.perf_counter()
        try:
            return self._inner.longest_prefix(keys, streams)
        finally:
            self._histogram.observe(time.perf_counter() - started)

    def stats(self, stream: StreamId) -> StreamStats:
        return self._inner.stats(stream)

    def close(self) -> None:
        self._inner.close()
