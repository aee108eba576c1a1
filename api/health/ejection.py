"""Passive ejection in the proxy: a circuit breaker per replica fed by forwarding outcomes,
written to the shared health records, and the ejection series."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvindex.api.config.settings import ApiSettings
from kvindex.api.health.routing import health_policy
from kvindex.api.loop.off_loop import OffLoop
from kvindex.indexer.fleet.registry import HealthChange, HealthUpdate, RegistryView
from kvindex.indexer.fleet.replica_health import Ejection, ReplicaHealth
from kvindex.indexer.index.protocol import IndexUnavailableError

logger = logging.getLogger("kvindex.proxy")


class EjectionMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        fleet: RegistryView,
        settings: ApiSettings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ejections = Counter(
            "kvindex_proxy_ejections",
            "Replicas ejected from routing by this proxy's health checks or breakers.",
            ["replica", "reason"],
            registry=registry,
        )
        self.stalled_checks = Counter(
            "kvindex_proxy_health_checks_stalled",
            "Health checks sent again because their deadline passed while this proxy itself was"
            " stalled (a busy loop or CPU): not counted against the replica (the log names it).",
            registry=registry,
        )
        ejected = Gauge(
            "kvindex_proxy_ejected_replicas",
            "Replicas out of routing now (failed health checks or an open breaker), as the"
            " shared fleet state says.",
            registry=registry,
        )
        policy = health_policy(settings)

        def count() -> float:
            now = clock()
            return sum(1 for h in fleet.replica_health().values() if h.ejection(now, policy))

        ejected.set_function(count)

    def ejected(self, replica: str, reason: Ejection) -> None:
        self.ejections.labels(replica, reason.value).inc()

    def check_stalled(self, _replica: str) -> None:
        self.stalled_checks.inc()


class ReplicaBreakers:
    """The breakers of one proxy, and when each replica last answered one of its forwards (a
    picker reports answers alone: the gateway acts on failures)."""

    def __init__(
        self,
        settings: ApiSettings,
        fleet: RegistryView,
        *,
        blocking_store: bool,
        clock: Callable[[], float] = time.time,
        on_ejected: Callable[[str, Ejection], None] = lambda _replica, _reason: None,
    ) -> None:
        self._fleet = fleet
        self._policy = health_policy(settings)
        self._off_loop = OffLoop(blocking_store)
        self._clock = clock
        self._on_ejected = on_ejected
        self._failures: dict[str, int] = {}
        self._answered: dict[str, float] = {}  # replica -> its latest outcome, when a success
        self._tasks: set[asyncio.Task[None]] = set()

    def outcome(self, replica: str, ok: bool, what: str) -> None:
        """One forward to ``replica`` succeeded (``ok``) or failed (``what`` says how)."""
        now = self._clock()
        record = self._fleet.replica_health().get(replica)
        half_open = record is not None and record.half_open(now)
        if ok:
            self._answered[replica] = now
            self._failures.pop(replica, None)
            if half_open:
                self._change(replica, ReplicaHealth.breaker_closed)
            return
        self._answered.pop(replica, None)
        if record is not None and record.ejection(now, self._policy) is Ejection.BREAKER:
            return  # already open: answers of requests sent before it opened
        failures = self._failures[replica] = self._failures.get(replica, 0) + 1
        if failures >= self._policy.breaker_failures or half_open:
            self._failures.pop(replica, None)
            policy = self._policy
            self._change(replica, lambda h: h.breaker_opened(now, policy, what))

    def answered_within(self, replica: str, within_s: float) -> bool:
        """``replica``'s latest forward outcome is a success, at most ``within_s`` ago."""
        at = self._answered.get(replica)
        return at is not None and self._clock() - at <= within_s

    def _change(self, replica: str, change: HealthChange) -> None:
        if not self._off_loop.blocking:
            self._apply(replica, change)
            return
        task = asyncio.get_running_loop().create_task(self._off_loop(self._apply, replica, change))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _apply(self, replica: str, change: HealthChange) -> None:
        try:
            updates = self._fleet.update_health({replica: change})
        except IndexUnavailableError as exc:
            logger.warning("breaker of %s: the fleet state is unreachable (%s)", replica, exc)
            return
        for name, update in updates.items():
            self._report(name, update)

    def _report(self, replica: str, update: HealthUpdate) -> None:
        before, after = update
        if after.breaker_open_until is not None and after.num_ejections > before.num_ejections:
            logger.warning("replica %s ejected: breaker open (%s)", replica, after.last_error)
            self._on_ejected(replica, Ejection.BREAKER)
        elif before.breaker_open_until is not None and after.breaker_open_until is None:
            logger.warning("replica %s restored: its breaker closed", replica)

    async def close(self) -> None:
        """Wait for the changes still being written."""
        if self._tasks:
            await asyncio.wait(set(self._tasks))
