"""The health policy the API's settings make."""

from __future__ import annotations

from kvindex.api.config.settings import ApiSettings
from kvindex.api.health.routing import health_policy


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
