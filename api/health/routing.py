"""Which candidates are out of routing, and why: ejected (failed health checks, an open
breaker, as the settings' :func:`health_policy` rules), or a connect-mode replica whose events
stream is down."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence

from kvindex.api.config.settings import ApiSettings
from kvindex.indexer.fleet.registry import RegistryView, StreamFreshness
from kvindex.indexer.fleet.replica_health import HealthPolicy


def health_policy(settings: ApiSettings) -> HealthPolicy:
    """A verdict holds three check rounds (at least 10 s): one no process renews stops ejecting."""
    return HealthPolicy(
        unhealthy_threshold=settings.unhealthy_threshold,
        healthy_threshold=settings.healthy_threshold,
        breaker_failures=settings.breaker_failures,
        breaker_cooldown_s=settings.breaker_cooldown_s,
        verdict_ttl_s=max(
            10.0, 3 * (settings.health_check_interval_s + settings.health_check_timeout_s)
        ),
    )


def ejected_at(registry: RegistryView, now: float, policy: HealthPolicy) -> frozenset[str]:
    """The replicas out of routing at ``now`` (failed health checks, an open breaker)."""
    health = registry.replica_health()
    if not health:
        return frozenset()
    return frozenset(r for r, h in health.items() if h.ejection(now, policy) is not None)


def ejected_now(
    registry: RegistryView,
    policy: HealthPolicy,
    *,
    clock: Callable[[], float] = time.time,
    period_s: float = 1.0,
) -> Callable[[], frozenset[str]]:
    """The replicas ejected now, read from the registry at most once per ``period_s``."""
    kept: tuple[float, frozenset[str]] = (-period_s, frozenset())

    def ejected() -> frozenset[str]:
        nonlocal kept
        now = clock()
        if now - kept[0] < period_s:
            return kept[1]
        kept = (now, ejected_at(registry, now, policy))
        return kept[1]

    return ejected


def out_of_routing(
    candidates: Sequence[str],
    registry: RegistryView,
    connecting: Collection[str],
    *,
    clock: Callable[[], float],
    policy: HealthPolicy,
    events_down_after_s: float,
) -> dict[str, str]:
    """The candidates out of routing, in candidate order, each with why."""
    health = registry.replica_health()
    judged = [r for r, h in health.items() if h.check_ejected or h.breaker_open_until is not None]
    down = registry.disconnected() if connecting else []
    down = [s for s in down if s.replica in connecting]
    if not judged and not down:
        return {}
    now, wanted = clock(), set(candidates)
    out: dict[str, str] = {}
    for replica in judged:
        if replica in wanted and health[replica].ejection(now, policy) is not None:
            out[replica] = health[replica].describe(now, policy)
    statuses: dict[str, list[StreamFreshness]] = {}
    for status in registry.freshness(down):
        statuses.setdefault(status.stream.replica, []).append(status)
    for replica, mine in statuses.items():
        if replica in wanted and replica not in out:
            why = events_down(mine, events_down_after_s)
            if why is not None:
                out[replica] = why
    return {r: out[r] for r in candidates if r in out}


def events_down(statuses: Sequence[StreamFreshness], after_s: float) -> str | None:
    """Why the events are down (None: not): a stream never heard, or silent for ``after_s``."""
    for status in statuses:
        if status.connected:
            continue
        gone, silent = status.disconnected_s, status.silent_s
        if gone is None and silent is None:
            return "events stream never connected"
        if gone is not None and gone >= after_s and (silent is None or silent >= after_s):
            return f"events stream disconnected {gone:.1f}s"
    return None


def no_healthy(unhealthy: dict[str, str]) -> str:
    whys = "; ".join(f"{replica}: {why}" for replica, why in sorted(unhealthy.items()))
    return f"no healthy candidate, every one ranked ({whys})"
