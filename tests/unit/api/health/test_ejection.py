"""kvindex.api.health.ejection: the per-replica breakers on a fake clock, fed by the
forwarder's outcomes (real replicas: tests/integration/test_proxy_health.py)."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client import CollectorRegistry, generate_latest

from kvindex.api.config.settings import ApiSettings
from kvindex.api.health.ejection import EjectionMetrics, ReplicaBreakers
from kvindex.api.health.routing import health_policy
from kvindex.clients.proxy.forwarding import Forwarder
from kvindex.clients.proxy.metrics import ProxyMetrics
from kvindex.clients.proxy.settings import ProxySettings
from kvindex.clients.proxy.upstream import Upstream
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.fleet.replica_health import Ejection
from tests.support.clock import Clock

SETTINGS = ApiSettings(breaker_failures=3, breaker_cooldown_s=10.0)
POLICY = health_policy(SETTINGS)


class Proxy:
    def __init__(self) -> None:
        self.clock = Clock()
        self.registry = Registry((ReplicaSpec("r1", "m"), ReplicaSpec("r2", "m")))
        self.ejected: list[tuple[str, Ejection]] = []
        self.breakers = ReplicaBreakers(
            SETTINGS,
            self.registry,
            blocking_store=False,
            clock=self.clock,
            on_ejected=lambda r, why: self.ejected.append((r, why)),
        )

    def feed(self, replica: str, outcomes: str) -> None:
        """One outcome per character: ``+`` a success, ``-`` a failure."""
        for outcome in outcomes:
            self.breakers.outcome(replica, outcome == "+", "connect")

    def why(self, replica: str) -> Ejection | None:
        record = self.registry.replica_health().get(replica)
        return None if record is None else record.ejection(self.clock.now, POLICY)


def test_consecutive_failures_open_the_breaker() -> None:
    proxy = Proxy()
    proxy.feed("r1", "--+--")
    assert proxy.why("r1") is None and proxy.ejected == []
    proxy.feed("r1", "-")
    assert proxy.why("r1") is Ejection.BREAKER
    assert proxy.ejected == [("r1", Ejection.BREAKER)]
    assert proxy.registry.replica_health()["r1"].last_error == "connect"
    assert proxy.why("r2") is None


def test_outcomes_while_open_change_nothing() -> None:
    proxy = Proxy()
    proxy.feed("r1", "---")
    until = proxy.registry.replica_health()["r1"].breaker_open_until
    proxy.clock.now += 5
    proxy.feed("r1", "---+")
    assert proxy.registry.replica_health()["r1"].breaker_open_until == until
    assert proxy.ejected == [("r1", Ejection.BREAKER)]


def test_half_open_one_failure_reopens_one_success_closes() -> None:
    proxy = Proxy()
    proxy.feed("r1", "---")
    proxy.clock.now += 10.0
    assert proxy.why("r1") is None  # half-open: it takes requests again
    proxy.feed("r1", "-")
    assert proxy.why("r1") is Ejection.BREAKER and len(proxy.ejected) == 2
    proxy.clock.now += 10.0
    proxy.feed("r1", "+")
    record = proxy.registry.replica_health()["r1"]
    assert record.breaker_open_until is None and not record.half_open(proxy.clock.now)
    proxy.feed("r1", "--")
    assert proxy.why("r1") is None  # counting starts over


def test_the_gauge_counts_replicas_ejected_now() -> None:
    proxy = Proxy()
    registry = CollectorRegistry()
    metrics = EjectionMetrics(registry, proxy.registry, SETTINGS, proxy.clock)
    proxy.feed("r1", "---")
    metrics.ejected("r1", Ejection.BREAKER)
    text = generate_latest(registry).decode()
    assert "kvindex_proxy_ejected_replicas 1.0" in text
    assert 'kvindex_proxy_ejections_total{reason="breaker",replica="r1"} 1.0' in text


def test_the_forwarder_reports_each_attempt() -> None:
    outcomes: list[tuple[str, bool, str]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host == "down":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(503 if host == "busy" else 200)

    async def run() -> None:
        forwarder = Forwarder(
            ProxySettings(),
            ProxyMetrics(),
            transport=httpx.MockTransport(handle),
            on_outcome=lambda r, ok, what: outcomes.append((r, ok, what)),
        )
        upstreams = [Upstream(h, f"http://{h}") for h in ("down", "busy", "ok")]
        opened = await forwarder.open("/v1/completions", b"{}", [], upstreams, forwarder.deadline())
        await opened.response.aclose()
        await forwarder.close()

    asyncio.run(run())
    assert outcomes == [
        ("down", False, "connect"),
        ("busy", False, "status_503"),
        ("ok", True, "status_200"),
    ]


def test_a_success_is_remembered_for_its_interval_a_failure_forgets_it() -> None:
    proxy = Proxy()
    assert not proxy.breakers.answered_within("r1", 1.0)
    proxy.feed("r1", "+")
    assert proxy.breakers.answered_within("r1", 1.0)
    assert not proxy.breakers.answered_within("r2", 1.0)
    proxy.clock.now += 1.5
    assert not proxy.breakers.answered_within("r1", 1.0)  # too long ago
    proxy.feed("r1", "+-")
    assert not proxy.breakers.answered_within("r1", 1.0)  # its latest outcome failed
