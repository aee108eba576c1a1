"""The health policy the API's settings make."""

from __future__ import annotations

from kvindex.api.config.settings import ApiSettings
from kvindex.api.health.routing import ejected_now, health_policy
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec


def test_the_policy_takes_the_settings_thresholds() -> None:
    settings = ApiSettings(
        unhealthy_threshold=4, healthy_threshold=3, breaker_failures=7, breaker_cooldown_s=2.5
    )
    policy = health_policy(settings)
    assert (policy.unhealthy_threshold, policy.healthy_threshold) == (4, 3)
    assert (policy.breaker_failures, policy.breaker_cooldown_s) == (7, 2.5)


def test_a_verdict_holds_three_check_rounds_and_at_least_ten_seconds() -> None:
    slow = ApiSettings(health_check_interval_s=5.0, health_check_timeout_s=1.0)
    assert health_policy(slow).verdict_ttl_s == 18.0
    assert health_policy(ApiSettings()).verdict_ttl_s == 10.0


def test_the_ejected_are_read_from_the_registry_at_most_once_a_period() -> None:
    registry = Registry((ReplicaSpec("r1", "m"), ReplicaSpec("r2", "m")))
    policy, now = health_policy(ApiSettings()), [100.0]
    ejected = ejected_now(registry, policy, clock=lambda: now[0], period_s=1.0)
    assert ejected() == frozenset()
    registry.update_health({"r2": lambda h: h.breaker_opened(100.0, policy, "status 502")})
    now[0] = 100.5
    assert ejected() == frozenset()  # read 0.5 s ago
    now[0] = 101.0
    assert ejected() == {"r2"}
    now[0] = 100.0 + policy.breaker_cooldown_s + 1.0
    assert ejected() == frozenset()  # the breaker's cool-down is over
