"""kvindex.indexer.fleet.replica_health: the ejection rules, on a fake clock."""

from __future__ import annotations

from kvindex.indexer.fleet.replica_health import HEALTHY, Ejection, HealthPolicy, ReplicaHealth
from tests.support.clock import Clock

POLICY = HealthPolicy(
    unhealthy_threshold=3,
    healthy_threshold=2,
    breaker_failures=5,
    breaker_cooldown_s=10.0,
    verdict_ttl_s=30.0,
)


def _checks(record: ReplicaHealth, outcomes: str, clock: Clock) -> ReplicaHealth:
    """Fold one check per character (``+`` pass, ``-`` fail), one second apart."""
    for outcome in outcomes:
        clock.now += 1
        ok = outcome == "+"
        record = record.after_check(ok, None if ok else "refused", clock.now, POLICY)
    return record


def test_three_consecutive_failures_eject_and_two_passes_restore() -> None:
    clock = Clock()
    two_down = _checks(HEALTHY, "--", clock)
    assert two_down.ejection(clock.now, POLICY) is None
    ejected = _checks(two_down, "-", clock)
    assert ejected.ejection(clock.now, POLICY) is Ejection.HEALTH_CHECK
    assert ejected.num_ejections == 1
    assert ejected.describe(clock.now, POLICY) == "ejected: 3 failed health checks (refused)"
    one_up = _checks(ejected, "+", clock)
    assert one_up.ejection(clock.now, POLICY) is Ejection.HEALTH_CHECK
    restored = _checks(one_up, "+", clock)
    assert restored.ejection(clock.now, POLICY) is None
    assert restored.describe(clock.now, POLICY) == "healthy"


def test_failures_must_be_consecutive() -> None:
    clock = Clock()
    record = _checks(HEALTHY, "--+--+--", clock)
    assert record.ejection(clock.now, POLICY) is None and record.num_ejections == 0
    # ejected, a pass then a failure: the passes restart from zero
    record = _checks(record, "-+-++", clock)
    assert record.num_ejections == 1
    assert record.ejection(clock.now, POLICY) is None


def test_more_failures_while_ejected_count_one_ejection() -> None:
    clock = Clock()
    record = _checks(HEALTHY, "------", clock)
    assert record.num_ejections == 1 and record.check_failures == 6


def test_a_verdict_nobody_renews_stops_ejecting() -> None:
    clock = Clock()
    record = _checks(HEALTHY, "---", clock)
    clock.now += POLICY.verdict_ttl_s
    assert record.ejection(clock.now, POLICY) is Ejection.HEALTH_CHECK
    clock.now += 0.1
    assert record.ejection(clock.now, POLICY) is None


def test_breaker_open_then_half_open_after_the_cooldown() -> None:
    clock = Clock()
    opened = HEALTHY.breaker_opened(clock.now, POLICY, "connect refused")
    assert opened.ejection(clock.now, POLICY) is Ejection.BREAKER
    assert not opened.half_open(clock.now)
    described = opened.describe(clock.now, POLICY)
    assert described == "ejected: breaker open 10.0s more (connect refused)"
    clock.now += 9.9
    assert opened.ejection(clock.now, POLICY) is Ejection.BREAKER
    clock.now += 0.1
    assert opened.ejection(clock.now, POLICY) is None and opened.half_open(clock.now)
    reopened = opened.breaker_opened(clock.now, POLICY, "status 503")
    assert reopened.ejection(clock.now, POLICY) is Ejection.BREAKER
    assert reopened.num_ejections == 2
    closed = reopened.breaker_closed()
    assert closed.ejection(clock.now, POLICY) is None and not closed.half_open(clock.now)


def test_opening_an_open_breaker_again_is_not_another_ejection() -> None:
    clock = Clock()
    opened = HEALTHY.breaker_opened(clock.now, POLICY, "x")
    clock.now += 1
    again = opened.breaker_opened(clock.now, POLICY, "y")
    assert again.num_ejections == 1
    assert again.breaker_open_until == clock.now + POLICY.breaker_cooldown_s
