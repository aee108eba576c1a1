"""kvindex.api.http.tally: observations kept as sums show, once collected, as observed."""

from __future__ import annotations

import random
import threading

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvindex.api.http.tally import Tally

_BUCKETS = (0.001, 0.01, 0.1, 1.0)


def _series(tallied: bool) -> tuple[CollectorRegistry, Tally | None, Histogram, Counter]:
    registry = CollectorRegistry(auto_describe=False)
    tally = Tally() if tallied else None
    if tally is not None:
        registry.register(tally)
    histogram = Histogram("t_seconds", "t", ["route"], buckets=_BUCKETS, registry=registry)
    counter = Counter("t_requests", "t", ["route"], registry=registry)
    return registry, tally, histogram, counter


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {
        (s.name, str(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_a_collection_shows_what_direct_observations_show() -> None:
    rng = random.Random(7)
    values = [0.0, 0.001, 0.01, 1.0, 5.0, *(rng.uniform(0, 2) for _ in range(200))]
    direct, _, histogram, counter = _series(tallied=False)
    tallied, tally, t_histogram, t_counter = _series(tallied=True)
    assert tally is not None
    timings = {r: tally.timings(t_histogram.labels(r), t_counter.labels(r)) for r in "ab"}
    for i, value in enumerate(values):
        route = "ab"[i % 2]
        histogram.labels(route).observe(value)
        counter.labels(route).inc()
        timings[route].observe(value)
    expected = _samples(direct)
    for _ in range(2):  # a second collection adds nothing more
        got = _samples(tallied)
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert abs(got[key] - value) < 1e-9, key
    timings["a"].observe(0.5)
    assert _samples(tallied)[("t_requests_total", "[('route', 'a')]")] == 104  # 103 before


def test_observations_from_threads_during_collections_are_all_counted() -> None:
    registry, tally, histogram, counter = _series(tallied=True)
    assert tally is not None
    timings = tally.timings(histogram.labels("a"), counter.labels("a"))
    seen: list[float] = []

    def observe() -> None:
        for _ in range(5000):
            timings.observe(0.005)

    threads = [threading.Thread(target=observe) for _ in range(3)]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        seen.append(_samples(registry)[("t_requests_total", "[('route', 'a')]")])
    for thread in threads:
        thread.join()
    assert _samples(registry)[("t_requests_total", "[('route', 'a')]")] == 15000
    assert seen == sorted(seen)


def test_counted_increments_show_once_collected_as_direct_ones() -> None:
    direct, _, _, counter = _series(tallied=False)
    tallied, tally, _, t_counter = _series(tallied=True)
    assert tally is not None
    counts = {r: tally.counts(t_counter.labels(r)) for r in "ab"}
    for i, amount in enumerate((1.0, 2.0, 0.5, 1.0, 3.0)):
        counter.labels("ab"[i % 2]).inc(amount)
        counts["ab"[i % 2]].inc(amount)
    assert _samples(tallied) == _samples(direct)
    assert _samples(tallied) == _samples(direct)  # a second collection adds nothing more
    counts["b"].inc()
    assert _samples(tallied)[("t_requests_total", "[('route', 'b')]")] == 4.0  # 3 before
