"""The active health checker: ``GET <url><health_check_path>`` of every replica each interval,
folded into its shared ``ReplicaHealth``; processes sharing a store split a round. Traffic
counts as health (:meth:`HealthChecker.count_traffic`); a replica a proxy finds silent is
checked at once (:meth:`HealthChecker.confirm_hang`); a check timed out while this process
stalled (:data:`STALL_S`) is sent again, and the second counts."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import httpx

from kvindex.api.config.settings import ApiSettings
from kvindex.api.health.routing import health_policy
from kvindex.api.loop.off_loop import OffLoop
from kvindex.api.loop.periodic import Periodic
from kvindex.api.loop.probe import Getter
from kvindex.indexer.fleet.registry import HealthChange, HealthUpdate, RegistryView
from kvindex.indexer.fleet.replica_health import Ejection, ReplicaHealth
from kvindex.indexer.index.protocol import IndexUnavailableError

logger = logging.getLogger("kvindex.health")
_CLAIM_SHARE = 0.8
STALL_S = 0.1
"""A timed-out check's deadline fired this late: the process, not the replica, was slow."""

Outcome = tuple[bool, str | None]
Answered = Callable[[str, float], bool]
"""Whether a replica's latest forward outcome is a success at most so many seconds ago."""
_PASSED: Outcome = (True, None)


class HealthChecker:
    def __init__(
        self,
        settings: ApiSettings,
        registry: RegistryView,
        client: Getter,
        *,
        blocking_store: bool,
        clock: Callable[[], float] = time.time,
        on_ejected: Callable[[str, Ejection], None] = lambda _replica, _reason: None,
        on_stalled: Callable[[str], None] = lambda _replica: None,
    ) -> None:
        self._registry = registry
        self._client = client
        self._interval_s = settings.health_check_interval_s
        self._timeout_s = settings.health_check_timeout_s
        self._path = settings.health_check_path
        self._policy = health_policy(settings)
        self._call = OffLoop(blocking_store)
        self._clock = clock
        self._on_ejected = on_ejected
        self._on_stalled = on_stalled
        self._rounds = (
            Periodic("the health checker", self.check_once, self._interval_s)
            if self._interval_s > 0
            else None
        )
        self._store_failing = False
        self._skip_on_traffic = settings.health_check_skip_on_traffic
        self._answered: Answered | None = None

    def count_traffic(self, answered: Answered) -> None:
        """Count a recent answered forward as a passed check (the proxy's breakers say)."""
        self._answered = answered

    async def start(self) -> None:
        if self._rounds is not None and not self._rounds.running:
            await self._rounds.start()

    async def stop(self) -> None:
        if self._rounds is not None:
            await self._rounds.stop()

    async def check_once(self) -> dict[str, HealthUpdate]:
        """One round over the replicas this process claims, applied in one update; the
        updates (empty when the store could not be reached)."""
        urls = {r.id: r.url for r in self._registry.replicas() if r.url}
        try:
            mine = await self._call(
                self._registry.claim_health_checks, list(urls), self._interval_s * _CLAIM_SHARE
            )
            passed = await self._answered_lately(mine)
            sent = sorted(mine - passed)
            outcomes = await asyncio.gather(*(self._check(r, urls[r]) for r in sent))
            now = self._clock()
            outcome_of = dict(zip(sent, outcomes, strict=True)) | dict.fromkeys(passed, _PASSED)
            changes = {r: self._change(outcome_of[r], now) for r in sorted(mine)}
            updates = await self._call(self._registry.update_health, changes)
        except IndexUnavailableError as exc:
            self._store(failing=str(exc))
            return {}
        self._store(failing=None)
        for replica, update in updates.items():
            self._report(replica, *update)
        return updates

    async def _answered_lately(self, replicas: set[str]) -> set[str]:
        """The replicas that pass this round on their traffic: their latest forward answered
        within the interval, and their record holds no ejection and no failed check."""
        answered = self._answered
        if answered is None or not self._skip_on_traffic:
            return set()
        recent = {r for r in replicas if answered(r, self._interval_s)}
        if not recent:
            return recent
        health = await self._call(self._registry.replica_health)
        return {r for r in recent if r not in health or _clean(health[r])}

    async def confirm_hang(self, replica: str, silent_s: float) -> bool:
        """``replica`` owes answers and sent no byte for ``silent_s``: checked now, a failed
        check ejects it at once (no further failures awaited). True: it failed (hung)."""
        url = next((r.url for r in self._registry.replicas() if r.id == replica and r.url), None)
        if url is None:
            return False
        ok, error = await self._check(replica, url)
        if ok:
            return False
        why = f"no byte for {silent_s:.1f}s with answers owed, then its check failed: {error}"
        change = self._change((False, why), self._clock(), unhealthy_threshold=1)
        try:
            updates = await self._call(self._registry.update_health, {replica: change})
        except IndexUnavailableError as exc:
            self._store(failing=str(exc))
            return True
        for name, update in updates.items():
            self._report(name, *update)
        return True

    def _change(
        self, outcome: Outcome, now: float, *, unhealthy_threshold: int | None = None
    ) -> HealthChange:
        ok, error = outcome
        policy = self._policy
        if unhealthy_threshold is not None:
            policy = dataclasses.replace(policy, unhealthy_threshold=unhealthy_threshold)

        def change(record: ReplicaHealth) -> ReplicaHealth:
            return record.after_check(ok, error, now, policy)

        return change

    async def _check(self, replica: str, base_url: str) -> Outcome:
        """The check's outcome; sent a second time when the first timed out on a stall."""
        url = base_url.rstrip("/") + self._path
        outcome, late_s = await self._attempt(url)
        if late_s > STALL_S:
            logger.warning(
                "health check of %s timed out while this process was stalled (its deadline"
                " fired %.2fs late); checked again",
                replica,
                late_s,
            )
            self._on_stalled(replica)
            outcome, _ = await self._attempt(url)
        return outcome

    async def _attempt(self, url: str) -> tuple[Outcome, float]:
        """The outcome, and how late past its deadline a timeout was noticed (else 0)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        try:
            # httpx's timeout is per phase; this bounds the whole check (slow trickles too).
            async with asyncio.timeout_at(deadline):
                response = await self._client.get(url, timeout=self._timeout_s)
        except (TimeoutError, httpx.TimeoutException):
            late_s = max(0.0, loop.time() - deadline)
            return (False, f"timed out after {self._timeout_s:g}s"), late_s
        except (httpx.HTTPError, httpx.InvalidURL, OSError) as exc:
            return (False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__), 0.0
        if not response.is_success:
            return (False, f"HTTP {response.status_code}"), 0.0
        return (True, None), 0.0

    def _report(self, replica: str, before: ReplicaHealth, after: ReplicaHealth) -> None:
        if after.check_ejected and not before.check_ejected:
            logger.warning(
                "replica %s ejected: %d failed health checks (%s)",
                replica,
                after.check_failures,
                after.last_error,
            )
            self._on_ejected(replica, Ejection.HEALTH_CHECK)
        elif before.check_ejected and not after.check_ejected:
            logger.warning("replica %s restored: it passes its health checks again", replica)

    def _store(self, *, failing: str | None) -> None:
        if failing is not None and not self._store_failing:
            logger.warning("health checks skipped: the fleet state is unreachable (%s)", failing)
        elif failing is None and self._store_failing:
            logger.warning("health checks resumed: the fleet state is reachable again")
        self._store_failing = failing is not None


def _clean(record: ReplicaHealth) -> bool:
    """Neither ejected (by checks or a breaker, even half-open) nor failing its checks."""
    ejected = record.check_ejected or record.breaker_open_until is not None
    return not ejected and record.check_failures == 0
