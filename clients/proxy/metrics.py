"""The proxy's Prometheus series (``kvindex_proxy_*``), on a registry of their own, beside
its build, its index lookups and (when it runs the write path) its streams and index, as
``kvindex serve`` shows them."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from kvindex.api.health.block_sizes import BlockSizeCheck
from kvindex.api.http.metrics import (
    BlockSizeCollector,
    TokenizerCollector,
    TokenizerViews,
    lookup_latency,
)
from kvindex.api.http.tally import Counts, Tally, Timings
from kvindex.api.load.desk import DeskSeries
from kvindex.clients.proxy.predictions import Prediction
from kvindex.clients.proxy.verdicts import UNDER_REASONS, VERDICTS
from kvindex.indexer.fleet.registry import RegistryView
from kvindex.indexer.index.protocol import BlockIndex
from kvindex.indexer.metrics import BuildInfo, IngestCollector

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip
_FRACTION_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
_ERROR_BUCKETS = (
    -16384.0, -4096.0, -1024.0, -256.0, -64.0, -16.0, -1.0, 0.0, 16.0, 64.0, 256.0, 1024.0,
    4096.0, 16384.0,
)  # fmt: skip
NO_REPLICA = "none"
M = TypeVar("M", bound=MetricWrapperBase)
RESERVATION_OPS = ("reserve", "release", "renew", "close")
"""The load-store calls of the reservations (``op`` of ``kvindex_proxy_reservation_failures``)."""


class ProxyMetrics:
    """Counters and histograms of forwarded requests; :meth:`render` is the text format."""

    def __init__(self, worker: int = 0) -> None:
        """``worker``: which of ``kvindex proxy --workers N`` this process is (0: the one)."""
        self.registry = CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], MetricWrapperBase] = {}
        self._tallied: dict[tuple[int, tuple[str, ...]], Timings | Counts] = {}
        r = self.registry
        self.tally = Tally()  # registered first: collected before the series it adds to
        r.register(self.tally)
        r.register(BuildInfo("proxy"))
        self.lookup_latency = lookup_latency(r)
        self.requests = Counter(
            "kvindex_proxy_requests",
            "Requests answered, by route template, HTTP status and answering replica.",
            ["route", "status", "replica"],
            registry=r,
        )
        self.first_byte = Histogram(
            "kvindex_proxy_time_to_first_byte_seconds",
            "From the request's arrival to the replica's answer starting (headers received).",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "kvindex_proxy_request_duration_seconds",
            "From the request's arrival to its last byte sent to the client.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "kvindex_proxy_upstream_errors",
            "Failed attempts on a replica, by kind (connect, timeout, status_5xx, protocol).",
            ["replica", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "kvindex_proxy_retries",
            "Requests sent again to another replica before the first byte reached the client.",
            ["route"],
            registry=r,
        )
        self.matched_fraction = Histogram(
            "kvindex_proxy_matched_fraction",
            "The chosen replica's cached share of the prompt (tokenized requests only).",
            buckets=_FRACTION_BUCKETS,
            registry=r,
        )
        self.head_decisions = Counter(
            "kvindex_proxy_head_decisions",
            "Requests chosen for on their prompt's head: no replica held its start, so the rest"
            " was tokenized while the replica answered, the reservation then recounted.",
            registry=r,
        )
        self.head_rest_failures = Counter(
            "kvindex_proxy_head_rest_failures",
            "Heads whose rest failed to tokenize (logged; no prediction is made of the request).",
            registry=r,
        )
        self.tokenize_failures = Counter(
            "kvindex_proxy_tokenize_failures",
            "Requests routed on load alone because their prompt could not be tokenized.",
            ["model"],
            registry=r,
        )

        self.in_flight = Gauge(
            "kvindex_proxy_in_flight",
            "Requests this proxy sent to a replica and has not finished (reserved in the load"
            " store, which sums every proxy's).",
            ["replica"],
            registry=r,
        )
        self.reservations_released = Counter(
            "kvindex_proxy_reservations_released",
            "Requests no longer in flight, by reason (done: last byte sent; error: attempt"
            " or stream failed; disconnect: the client went away; shutdown: the proxy stopped).",
            ["reason"],
            registry=r,
        )
        self.reservation_failures = Counter(
            "kvindex_proxy_reservation_failures",
            "Load-store calls of the reservations that failed, by operation (reserve, release,"
            " renew, close); a request whose reserve failed is sent unreserved.",
            ["op"],
            registry=r,
        )
        for op in RESERVATION_OPS:  # present from the start, so rate() sees the first
            self.reservation_failures.labels(op)
        self.worker = Gauge(
            "kvindex_proxy_worker_info",
            "The worker processes (1 each): with --workers N a scrape shows every worker's"
            " series, each labelled worker.",
            ["worker", "pid"],
            registry=r,
        )
        self.worker.labels(str(worker), str(os.getpid())).set(1)
        self.worker_scrape_failures = Counter(
            "kvindex_proxy_worker_scrape_failures",
            "Sibling workers whose series a scrape left out (no answer on their socket in time).",
            registry=r,
        )
        self.receipt_write_failures = Counter(
            "kvindex_proxy_receipt_write_failures",
            "Receipts the shared journal store (the Redis Stream) did not take: kept in this"
            " proxy's memory only.",
            registry=r,
        )
        self.reservations_lost = Counter(
            "kvindex_proxy_reservations_lost",
            "Reservations that stopped counting because this proxy's lease lapsed (renewals"
            " failed for a whole lease TTL) while their requests were in flight.",
            registry=r,
        )

        self.predictions = Counter(
            "kvindex_proxy_predictions",
            "Routed requests by how the index's prediction on the chosen replica compared with"
            " the engine's reported cached tokens (exact, over_predicted, under_predicted,"
            " token_mismatch, unreported).",
            ["replica", "model", "outcome"],
            registry=r,
        )
        self.prediction_error = Histogram(
            "kvindex_proxy_prediction_error_tokens",
            "Predicted cached tokens (capped as the engine caps them) minus the engine's"
            " reported cached tokens, per compared request (positive: over-predicted).",
            ["replica"],
            buckets=_ERROR_BUCKETS,
            registry=r,
        )

        self._verdict_series(r)

    def _verdict_series(self, r: CollectorRegistry) -> None:
        self.verdicts = Counter(
            "kvindex_proxy_verdicts",
            "Verdicts on the predictions: over_predicted (a replica's streams cleared and its"
            " cache term discounted), token_mismatch (the first on a model).",
            ["verdict"],
            registry=r,
        )
        for verdict in VERDICTS:
            self.verdicts.labels(verdict)
        self.under_predictions = Counter(
            "kvindex_proxy_under_predictions",
            "Under-predicted requests by likely reason (block_size, partial_view, lag,"
            " lost_stores).",
            ["reason"],
            registry=r,
        )
        for reason in UNDER_REASONS:
            self.under_predictions.labels(reason)
        self.distrusted_replicas = Gauge(
            "kvindex_proxy_distrusted_replicas",
            "Replicas whose cache term is discounted now (over-predicted, not exact again yet).",
            registry=r,
        )
        self.token_mismatch_models = Gauge(
            "kvindex_proxy_token_mismatch_models",
            "Models on which the engine's prompt_tokens differed from the router's count.",
            registry=r,
        )

    def verdict(self, verdict: str) -> None:
        self.child(self.verdicts, verdict).inc()

    def under_predicted(self, reason: str) -> None:
        self.child(self.under_predictions, reason).inc()

    def distrusted(self, num_replicas: int) -> None:
        self.distrusted_replicas.set(num_replicas)

    def mismatched(self, num_models: int) -> None:
        self.token_mismatch_models.set(num_models)

    def desk_series(self) -> DeskSeries:
        return DeskSeries(self.in_flight, self.reservations_released, self.reservation_failures)

    def observe_prediction(self, prediction: Prediction, outcome: str, error: int | None) -> None:
        """Count one classified request (see :mod:`.predictions`)."""
        replica = prediction.replica
        self.counted(self.predictions, replica, prediction.model, outcome).inc()
        if error is not None:
            self.timed(self.prediction_error, replica).observe(error)

    def child(self, metric: M, *labels: str) -> M:
        """``metric.labels(*labels)``, found once and then kept (prometheus' own lookup
        locks, checks and joins the values on each call)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return cast("M", found)

    def timed(self, metric: Histogram, *labels: str) -> Timings:
        # The request path's observations of the series, added to it at a scrape; kept.
        return cast("Timings", self._kept(metric, labels, self.tally.timings))

    def counted(self, metric: Counter, *labels: str) -> Counts:
        # :meth:`timed` for a counter's increments.
        return cast("Counts", self._kept(metric, labels, self.tally.counts))

    def _kept(
        self, metric: M, labels: tuple[str, ...], make: Callable[[M], Timings | Counts]
    ) -> Timings | Counts:
        key = (id(metric), labels)
        found = self._tallied.get(key)
        if found is None:
            series = self.child(metric, *labels) if labels else metric
            found = self._tallied[key] = make(series)
        return found

    def watch_write_path(self, fleet: RegistryView, index: BlockIndex) -> None:
        """Export the write path this process runs: stream counters and gauges, blocks."""
        self.registry.register(IngestCollector(fleet, index))

    def watch_block_sizes(self, check: BlockSizeCheck) -> None:
        self.registry.register(BlockSizeCollector(check))

    def watch_tokenizers(self, tokenizers: TokenizerViews) -> None:
        self.registry.register(TokenizerCollector(tokenizers))

    def render(self, models: Iterable[str] = ()) -> bytes:
        """The text format; each of ``models`` (those served now) has its tokenize-failure
        series from the start, so rate() sees the first."""
        for model in models:
            self.tokenize_failures.labels(model)
        return generate_latest(self.registry)
