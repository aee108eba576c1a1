"""The picker's Prometheus series (``kvindex_picker_*``), on a registry of their own beside
its build and its index lookups; served on the metrics port."""

from __future__ import annotations

from typing import TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from kvindex.api.http.metrics import lookup_latency
from kvindex.api.load.desk import DeskSeries
from kvindex.indexer.metrics import BuildInfo

_DECISION_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
OUTCOMES = (
    "routed", "bad_request", "unknown_model", "no_endpoint", "subset_miss", "shed",
    "too_large", "error",
)  # fmt: skip
"""``outcome`` of a decision: an endpoint named, or why the gateway answers itself."""
M = TypeVar("M", bound=MetricWrapperBase)
RELEASE_REASONS = ("done", "abandoned", "shutdown")
"""Why a request stopped counting: the response's end; the stream closed, reset or cancelled
before it; the picker stopped."""


class PickerMetrics:
    """Decisions by outcome, their latency, subset misses, requests in flight."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self._children: dict[tuple[int, str], MetricWrapperBase] = {}
        r.register(BuildInfo("picker"))
        self.lookup_latency = lookup_latency(r)
        self.decisions = Counter(
            "kvindex_picker_decisions",
            "Requests decided, by outcome (routed: endpoints named; else the gateway's own"
            " answer: bad_request 400, unknown_model 404, too_large 413, shed 429,"
            " no_endpoint and subset_miss 503, error 500).",
            ["outcome"],
            registry=r,
        )
        for outcome in OUTCOMES:  # present from the start, so rate() sees the first
            self.decisions.labels(outcome)
        self.decision_latency = Histogram(
            "kvindex_picker_decision_seconds",
            "From a request's last body chunk received to its answer sent (parse, tokenize,"
            " score, reserve).",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.head_decisions = Counter(
            "kvindex_picker_head_decisions",
            "Requests decided on their prompt's head: no replica held its start, so the rest"
            " was tokenized after the answer, its reservation then recounted.",
            registry=r,
        )
        self.head_rest_failures = Counter(
            "kvindex_picker_head_rest_failures",
            "Heads whose rest failed to tokenize after the answer (logged; nothing is kept).",
            registry=r,
        )
        self.subset_misses = Counter(
            "kvindex_picker_subset_misses",
            "Requests whose subset hint named no endpoint able to serve (answered 503).",
            registry=r,
        )
        self.in_flight = Gauge(
            "kvindex_picker_in_flight",
            "Requests this picker chose for and has not seen end (reserved in the load store).",
            ["replica"],
            registry=r,
        )
        self.released = Counter(
            "kvindex_picker_reservations_released",
            "Requests no longer in flight, by reason (done: the response's end; abandoned: the"
            " stream closed, reset or cancelled before it; shutdown: the picker stopped).",
            ["reason"],
            registry=r,
        )
        for reason in RELEASE_REASONS:
            self.released.labels(reason)
        self.served_elsewhere = Counter(
            "kvindex_picker_served_elsewhere",
            "Responses the gateway reports served by another endpoint than the primary (a"
            " fallback): the reservation moves there.",
            registry=r,
        )
        self.reservation_failures = Counter(
            "kvindex_picker_reservation_failures",
            "Load-store calls of the reservations that failed, by operation.",
            ["op"],
            registry=r,
        )

    def desk_series(self) -> DeskSeries:
        return DeskSeries(self.in_flight, self.released, self.reservation_failures)

    def child(self, metric: M, label: str) -> M:
        """``metric.labels(label)``, found once and then kept (prometheus' lookup locks)."""
        key = (id(metric), label)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(label)
        return cast("M", found)
