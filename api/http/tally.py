"""Reference: prometheus_client's Counter.inc and Histogram.observe; tests/unit/api/http/test_tally.py::test_a_collection_shows_what_direct_observations_show

Request-path observations and increments kept as sums under one lock, added to their series
at collection.
"""  # noqa: E501

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client.metrics_core import Metric


class Timings:
    """A histogram series' observations (each a counter's increment too) until collected."""

    __slots__ = ("_bounds", "_counter", "_counts", "_histogram", "_lock", "_total")

    def __init__(self, lock: threading.Lock, histogram: Histogram, counter: Counter | None):
        self._lock, self._histogram, self._counter = lock, histogram, counter
        self._bounds: list[float] = histogram._upper_bounds  # the last one is +Inf
        self._counts = [0] * len(self._bounds)
        self._total = 0.0

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._counts[bisect_left(self._bounds, seconds)] += 1
            self._total += seconds

    def flush(self) -> None:
        counts = self._counts
        observed = sum(counts)
        if not observed:
            return
        buckets: list[Any] = self._histogram._buckets
        for i, count in enumerate(counts):
            if count:
                buckets[i].inc(count)
        self._counts = [0] * len(counts)
        self._histogram._sum.inc(self._total)
        self._total = 0.0
        if self._counter is not None:
            self._counter.inc(observed)


class Counts:
    """A counter series' increments until collected."""

    __slots__ = ("_counter", "_lock", "_total")

    def __init__(self, lock: threading.Lock, counter: Counter) -> None:
        self._lock, self._counter = lock, counter
        self._total = 0.0

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self._total += amount

    def flush(self) -> None:
        if self._total:
            self._counter.inc(self._total)
            self._total = 0.0


class Tally:
    """A collector adding its timings and counts to their series: registered before them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[Timings | Counts] = []

    def timings(self, histogram: Histogram, counter: Counter | None = None) -> Timings:
        """Observations of ``histogram`` (a child when labelled), each one ``counter``'s too."""
        made = Timings(self._lock, histogram, counter)
        with self._lock:
            self._kept.append(made)
        return made

    def counts(self, counter: Counter) -> Counts:
        made = Counts(self._lock, counter)
        with self._lock:
            self._kept.append(made)
        return made

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            for kept in self._kept:
                kept.flush()
        return iter(())
