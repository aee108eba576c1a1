"""One replica's serving health (:class:`ReplicaHealth`): an active-check verdict and a circuit
breaker fed by forwarding outcomes; records are values, every change a pure function."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgspec


class Ejection(enum.StrEnum):
    """Why a replica is out of routing (the ``reason`` label of the ejection counter)."""

    HEALTH_CHECK = "health_check"
    BREAKER = "breaker"


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """The thresholds of both verdicts (from the API settings)."""

    unhealthy_threshold: int = 3
    """Consecutive failed checks that eject a replica."""
    healthy_threshold: int = 2
    """Consecutive passed checks that restore an ejected replica."""
    breaker_failures: int = 5
    """Consecutive failed forwards that open the breaker."""
    breaker_cooldown_s: float = 10.0
    """How long an open breaker keeps the replica out before it is tried again."""
    verdict_ttl_s: float = 10.0
    """A check verdict older than this is not trusted (no process checks any more)."""


class ReplicaHealth(msgspec.Struct, frozen=True, kw_only=True):
    """One replica's health record (wall-clock timestamps: other processes read it)."""

    check_failures: int = 0
    check_successes: int = 0
    check_ejected: bool = False
    checked_at: float | None = None
    last_error: str | None = None
    breaker_open_until: float | None = None
    """None: the breaker is closed. In the future: open; in the past: half-open."""
    num_ejections: int = 0

    # --- verdicts ------------------------------------------------------------------------

    def ejection(self, now: float, policy: HealthPolicy) -> Ejection | None:
        """Why the replica is out of routing at ``now``, or None."""
        if self.breaker_open_until is not None and now < self.breaker_open_until:
            return Ejection.BREAKER
        checked = self.checked_at
        if self.check_ejected and checked is not None and now - checked <= policy.verdict_ttl_s:
            return Ejection.HEALTH_CHECK
        return None

    def half_open(self, now: float) -> bool:
        """The breaker's cool-down is over but no outcome has closed it yet."""
        return self.breaker_open_until is not None and now >= self.breaker_open_until

    def describe(self, now: float, policy: HealthPolicy) -> str:
        why = self.ejection(now, policy)
        error = f" ({self.last_error})" if self.last_error else ""
        if why is Ejection.BREAKER:
            assert self.breaker_open_until is not None
            left = self.breaker_open_until - now
            return f"ejected: breaker open {left:.1f}s more{error}"
        if why is Ejection.HEALTH_CHECK:
            return f"ejected: {self.check_failures} failed health checks{error}"
        return "healthy"

    # --- changes (pure) ------------------------------------------------------------------

    def after_check(
        self, ok: bool, error: str | None, now: float, policy: HealthPolicy
    ) -> ReplicaHealth:
        """The record once an active check passed (``ok``) or failed with ``error``."""
        if ok:
            successes = self.check_successes + 1
            restored = self.check_ejected and successes >= policy.healthy_threshold
            return msgspec.structs.replace(
                self,
                check_failures=0,
                check_successes=successes,
                check_ejected=self.check_ejected and not restored,
                checked_at=now,
            )
        failures = self.check_failures + 1
        ejected = self.check_ejected or failures >= policy.unhealthy_threshold
        return msgspec.structs.replace(
            self,
            check_failures=failures,
            check_successes=0,
            check_ejected=ejected,
            checked_at=now,
            last_error=error,
            num_ejections=self.num_ejections + (ejected and not self.check_ejected),
        )

    def breaker_opened(self, now: float, policy: HealthPolicy, error: str) -> ReplicaHealth:
        """The record with the breaker (re)opened for a cool-down from ``now``."""
        counted = self.breaker_open_until is None or self.half_open(now)
        return msgspec.structs.replace(
            self,
            breaker_open_until=now + policy.breaker_cooldown_s,
            last_error=error,
            num_ejections=self.num_ejections + counted,
        )

    def breaker_closed(self) -> ReplicaHealth:
        return msgspec.structs.replace(self, breaker_open_until=None)


HEALTHY = ReplicaHealth()  # a replica nothing was learnt about yet
