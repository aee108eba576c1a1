"""kvindex.api.health.checker: rounds of checks over a mock transport, on a fake clock
(real replicas: tests/integration/test_proxy_health.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import fakeredis
import httpx
import pytest

from kvindex.api.config.settings import ApiSettings
from kvindex.api.health.checker import HealthChecker
from kvindex.api.health.routing import health_policy
from kvindex.indexer.fleet.registry import Registry, RegistryView
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.fleet.replica_health import Ejection
from kvindex.indexer.fleet.view import RedisFleetView
from kvindex.indexer.index.protocol import IndexUnavailableError
from kvindex.indexer.redis.schema import Schema
from tests.support.clock import Clock

SETTINGS = ApiSettings()  # checks every 1 s, 0.5 s timeout, 2 failures eject
SPECS = (
    ReplicaSpec("up", "m", url="http://up:8000"),
    ReplicaSpec("down", "m", url="http://down:8000/"),
    ReplicaSpec("sick", "m", url="http://sick:8000"),
    ReplicaSpec("nourl", "m"),
)


class Replicas:
    """A mock transport: ``up`` answers 200, ``sick`` 503, ``down`` refuses; a host in
    ``refused`` refuses too."""

    def __init__(self) -> None:
        self.refused = {"down"}
        self.paths: list[str] = []
        self.ejected: list[tuple[str, Ejection]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(f"{request.url.host}{request.url.path}")
        if request.url.host in self.refused:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(503 if request.url.host == "sick" else 200)


def _rounds(
    registry: RegistryView, replicas: Replicas, clock: Clock, num_rounds: int
) -> list[tuple[str, Ejection]]:
    """Run rounds one second apart; the ejections reported."""
    ejected: list[tuple[str, Ejection]] = []

    async def main() -> None:
        transport = httpx.MockTransport(replicas)
        async with httpx.AsyncClient(transport=transport) as client:
            checker = HealthChecker(
                SETTINGS,
                registry,
                client,
                blocking_store=False,
                clock=clock,
                on_ejected=lambda r, why: ejected.append((r, why)),
            )
            for _ in range(num_rounds):
                clock.now += 1.0
                await checker.check_once()

    asyncio.run(main())
    return ejected


def _ejected(registry: RegistryView, clock: Clock) -> set[str]:
    policy = health_policy(SETTINGS)
    return {r for r, h in registry.replica_health().items() if h.ejection(clock.now, policy)}


def test_the_second_failed_round_ejects_and_two_good_ones_restore() -> None:
    clock, replicas = Clock(), Replicas()
    registry = Registry(SPECS, clock=clock)
    assert _rounds(registry, replicas, clock, 1) == []
    assert _ejected(registry, clock) == set()
    ejected = _rounds(registry, replicas, clock, 1)
    assert sorted(ejected) == [("down", Ejection.HEALTH_CHECK), ("sick", Ejection.HEALTH_CHECK)]
    health = registry.replica_health()
    assert health["sick"].last_error == "HTTP 503"
    assert health["down"].last_error == "ConnectError: connection refused"
    assert "nourl" not in health and _ejected(registry, clock) == {"down", "sick"}
    assert "down/health" in replicas.paths and "up/health" in replicas.paths
    replicas.refused.clear()
    _rounds(registry, replicas, clock, 1)
    assert _ejected(registry, clock) == {"down", "sick"}
    _rounds(registry, replicas, clock, 1)
    assert _ejected(registry, clock) == {"sick"}


def test_a_slow_replica_fails_by_the_timeout() -> None:
    clock = Clock()
    registry = Registry((ReplicaSpec("slow", "m", url="http://slow"),), clock=clock)

    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5)
        return httpx.Response(200)

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(slow)) as client:
            checker = HealthChecker(SETTINGS, registry, client, blocking_store=False, clock=clock)
            await checker.check_once()

    asyncio.run(main())
    assert registry.replica_health()["slow"].last_error == "timed out after 0.5s"


def _checked_by(handler: object) -> tuple[Registry, list[str]]:
    """One round on replica ``r`` answered by ``handler``; the registry and the stalls reported."""
    clock = Clock()
    registry = Registry((ReplicaSpec("r", "m", url="http://r"),), clock=clock)
    stalled: list[str] = []

    async def main() -> None:
        transport = httpx.MockTransport(handler)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport) as client:
            checker = HealthChecker(
                SETTINGS, registry, client, blocking_store=False, clock=clock,
                on_stalled=stalled.append,
            )  # fmt: skip
            await checker.check_once()

    asyncio.run(main())
    return registry, stalled


def test_a_check_that_timed_out_while_the_process_stalled_is_sent_again_and_not_counted() -> None:
    calls: list[float] = []

    async def answered_while_stalled(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        if len(calls) == 1:
            time.sleep(0.8)  # the process stalls past the 0.5 s deadline
            await asyncio.sleep(5)
        return httpx.Response(200)

    registry, stalled = _checked_by(answered_while_stalled)
    assert len(calls) == 2 and stalled == ["r"]
    health = registry.replica_health()["r"]
    assert health.check_failures == 0 and health.check_successes == 1


def test_a_timeout_on_time_counts_against_the_replica_and_is_not_sent_again() -> None:
    calls: list[float] = []

    async def slow(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        await asyncio.sleep(5)
        return httpx.Response(200)

    registry, stalled = _checked_by(slow)
    assert len(calls) == 1 and stalled == []
    assert registry.replica_health()["r"].check_failures == 1


def test_processes_sharing_redis_check_each_replica_once_a_round() -> None:
    client = fakeredis.FakeRedis()
    clock, replicas = Clock(), Replicas()
    views = [RedisFleetView(client, Schema("t"), cache_ttl_s=0.0, clock=clock) for _ in range(2)]
    for spec in SPECS:
        views[0].add(spec)
    for view in views:
        _rounds(view, replicas, clock, 1)
    assert sorted(replicas.paths) == ["down/health", "sick/health", "up/health"]
    # both views read one record per replica, counted once
    assert views[1].replica_health()["down"].check_failures == 1


class DownRegistry(Registry):
    def claim_health_checks(self, replicas: Sequence[str], hold_s: float) -> set[str]:
        raise IndexUnavailableError("redis: down")


def test_an_unreachable_store_skips_the_round() -> None:
    clock, replicas = Clock(), Replicas()
    registry = DownRegistry(SPECS, clock=clock)
    assert _rounds(registry, replicas, clock, 3) == []
    assert replicas.paths == [] and registry.replica_health() == {}


def test_start_and_stop_on_a_zero_interval_do_nothing() -> None:
    settings = ApiSettings(health_check_interval_s=0)

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            checker = HealthChecker(settings, Registry(SPECS), client, blocking_store=False)
            await checker.start()
            await checker.stop()

    asyncio.run(main())


def _confirm(registry: RegistryView, replicas: Replicas, clock: Clock, replica: str) -> bool:
    """One hang confirmation of ``replica`` (silent 1.2 s); the ejections reported go to
    ``replicas.ejected``."""

    async def main() -> bool:
        async with httpx.AsyncClient(transport=httpx.MockTransport(replicas)) as client:
            checker = HealthChecker(
                SETTINGS,
                registry,
                client,
                blocking_store=False,
                clock=clock,
                on_ejected=lambda r, why: replicas.ejected.append((r, why)),
            )
            return await checker.confirm_hang(replica, 1.2)

    return asyncio.run(main())


def test_a_silent_replica_failing_its_check_is_ejected_at_once_a_passing_one_is_left_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, replicas = Clock(), Replicas()
    registry = Registry(SPECS, clock=clock)
    assert not _confirm(registry, replicas, clock, "up")
    assert not _confirm(registry, replicas, clock, "nourl")
    assert registry.replica_health() == {} and _ejected(registry, clock) == set()
    assert _confirm(registry, replicas, clock, "down")  # one failure is enough
    assert _ejected(registry, clock) == {"down"}
    assert replicas.ejected == [("down", Ejection.HEALTH_CHECK)]
    assert "replica down ejected" in caplog.text and "no byte for 1.2s" in caplog.text
    replicas.refused.clear()  # it answers again: the usual rounds restore it
    _rounds(registry, replicas, clock, SETTINGS.healthy_threshold)
    assert "down" not in _ejected(registry, clock)


def _traffic_rounds(
    registry: Registry, replicas: Replicas, clock: Clock, answered: set[str], num_rounds: int
) -> list[tuple[str, Ejection]]:
    """Rounds as :func:`_rounds`, the replicas in ``answered`` having just answered a forward."""
    ejected: list[tuple[str, Ejection]] = []

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(replicas)) as client:
            checker = HealthChecker(
                SETTINGS, registry, client, blocking_store=False, clock=clock,
                on_ejected=lambda r, why: ejected.append((r, why)),
            )  # fmt: skip
            checker.count_traffic(lambda replica, within_s: replica in answered and within_s > 0)
            for _ in range(num_rounds):
                clock.now += 1.0
                await checker.check_once()

    asyncio.run(main())
    return ejected


def test_a_replica_that_answered_traffic_passes_the_round_without_a_check() -> None:
    clock, replicas = Clock(), Replicas()
    registry = Registry(SPECS, clock=clock)
    ejected = _traffic_rounds(registry, replicas, clock, {"up", "sick"}, 2)
    assert ejected == [("down", Ejection.HEALTH_CHECK)]
    assert sorted(replicas.paths) == ["down/health", "down/health"]  # no traffic: checked
    health = registry.replica_health()
    assert health["up"].check_successes == 2 and health["up"].checked_at == clock.now
    assert health["sick"].check_successes == 2 and not health["sick"].check_ejected
    assert _ejected(registry, clock) == {"down"}


def test_traffic_does_not_spare_an_ejected_or_failing_replica_its_check() -> None:
    clock, replicas = Clock(), Replicas()
    registry = Registry(SPECS, clock=clock)
    _rounds(registry, replicas, clock, 1)  # down and sick fail once
    replicas.paths.clear()
    _traffic_rounds(registry, replicas, clock, {"up", "down", "sick"}, 2)
    assert sorted(replicas.paths) == ["down/health"] * 2 + ["sick/health"] * 2
    assert _ejected(registry, clock) == {"down", "sick"}
    replicas.paths.clear()
    replicas.refused.clear()  # down answers again: restored by real checks only
    _traffic_rounds(registry, replicas, clock, {"down"}, 2)
    assert replicas.paths.count("down/health") == 2
    assert "down" not in _ejected(registry, clock)
    replicas.paths.clear()
    _traffic_rounds(registry, replicas, clock, {"down"}, 1)
    assert "down/health" not in replicas.paths  # clean again: its traffic counts


def test_the_setting_off_checks_every_replica() -> None:
    settings = ApiSettings(health_check_skip_on_traffic=False)
    clock, replicas = Clock(), Replicas()
    registry = Registry(SPECS, clock=clock)

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(replicas)) as client:
            checker = HealthChecker(settings, registry, client, blocking_store=False, clock=clock)
            checker.count_traffic(lambda _replica, _within_s: True)
            await checker.check_once()

    asyncio.run(main())
    assert sorted(replicas.paths) == ["down/health", "sick/health", "up/health"]


def test_a_hang_is_confirmed_by_a_real_check_whatever_the_traffic() -> None:
    clock, replicas = Clock(), Replicas()
    registry = Registry(SPECS, clock=clock)

    async def main() -> bool:
        async with httpx.AsyncClient(transport=httpx.MockTransport(replicas)) as client:
            checker = HealthChecker(SETTINGS, registry, client, blocking_store=False, clock=clock)
            checker.count_traffic(lambda _replica, _within_s: True)
            return await checker.confirm_hang("down", 1.2)

    assert asyncio.run(main()) and replicas.paths == ["down/health"]
