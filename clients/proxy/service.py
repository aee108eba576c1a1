"""The ``kvindex proxy`` process: the read path assembled as the API's processes do, the
proxy's app on top, under uvicorn.

With the memory store (the default) the process runs the indexer too, as ``kvindex serve``
does (:class:`kvindex.api.http.server.Service`: its own subscriber to every replica's events);
with ``store = "redis"`` it reads the index, load and fleet a ``kvindex indexer`` writes, as
``kvindex api`` does (:func:`kvindex.api.http.server.api_deps`). Either way the scorer is the
one ``/score`` uses, on the same settings (``[api]``, ``[[models]]``), and each replica's
load is scraped from its ``/metrics`` (``api.scrape_interval_s``). The requests it sends are
reserved in that load store's ledger under the proxy's lease (``proxy.lease_ttl_s``,
renewed by a :class:`~kvindex.api.load.reservations.LeaseKeeper`), so other proxies and
``/score`` on the same Redis count them. Each replica's health is checked
(:mod:`kvindex.api.health.checker`) and judged by the forwards' outcomes (:mod:`.ejection`):
an ejected replica is left out of the scorer's ranking, so never chosen while another one is
healthy.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from starlette.applications import Starlette

from kvindex.api.config.settings import ApiSettings
from kvindex.api.health.checker import HealthChecker
from kvindex.api.health.ejection import EjectionMetrics, ReplicaBreakers
from kvindex.api.http.app import ApiDeps
from kvindex.api.http.server import Service, api_deps, run_app
from kvindex.api.load.reservations import LeaseKeeper, Reservations
from kvindex.api.load.scraper import MetricsScraper
from kvindex.api.score import Scorer
from kvindex.api.tokenize.failover import ProxyTokenizers
from kvindex.clients.proxy.app import ProxyParts, create_proxy_app
from kvindex.clients.proxy.forwarding import Forwarder, ReservationDesk
from kvindex.clients.proxy.metrics import ProxyMetrics
from kvindex.clients.proxy.settings import ProxySettings
from kvindex.clients.proxy.upstream import UpstreamPicker
from kvindex.indexer.config.settings import IndexerSettings


def build_proxy_app(deps: ApiDeps, proxy: ProxySettings) -> Starlette:
    """The proxy's app on ``deps`` (the caller owns the stores behind them). Its HTTP
    clients (tokenizers and scraping; forwarding) and the scraper live as long as the app
    runs (its lifespan)."""
    api = deps.settings
    metrics = ProxyMetrics()
    http = httpx.AsyncClient(timeout=api.scrape_timeout_s, trust_env=False)
    tokenizers = ProxyTokenizers(api, deps.registry, http)
    scorer = Scorer(
        api,
        deps.index,
        deps.registry,
        deps.loads,
        tokenizers=tokenizers.tokenizer,
        blocking_store=deps.blocking_store,
    )
    picker = UpstreamPicker(
        scorer,
        deps.registry,
        on_tokenize_failure=lambda model: metrics.tokenize_failures.labels(model).inc(),
        lora_base=api.lora_base,
        health_policy=api.health_policy(),
    )
    reservations = Reservations(
        deps.loads.ledger, proxy.lease_ttl_s, on_lost=metrics.reservations_lost.inc
    )
    desk = ReservationDesk(reservations, metrics, blocking=deps.blocking_store)
    ejections = EjectionMetrics(metrics.registry, deps.registry, api)
    breakers = ReplicaBreakers(
        api, deps.registry, blocking_store=deps.blocking_store, on_ejected=ejections.ejected
    )
    forwarder = Forwarder(proxy, metrics, desk=desk, on_outcome=breakers.outcome)
    scraper = _scraper(deps, http)
    keeper = LeaseKeeper(
        reservations,
        blocking=deps.blocking_store,
        on_failure=metrics.reservation_failures.labels("renew").inc,
    )
    checker = HealthChecker(
        api, deps.registry, http, blocking_store=deps.blocking_store, on_ejected=ejections.ejected
    )

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        if scraper is not None:
            await scraper.start()
        await keeper.start()
        await checker.start()
        try:
            yield
        finally:
            await checker.stop()
            if scraper is not None:
                await scraper.stop()
            await keeper.stop()
            await desk.close()  # after the drain: what is still reserved is released
            await forwarder.close()
            await breakers.close()
            await http.aclose()

    parts = ProxyParts(
        api, deps.registry, deps.index, picker, forwarder, metrics, deps.blocking_store, proxy=proxy
    )
    return create_proxy_app(parts, lifespan)


def _scraper(deps: ApiDeps, http: httpx.AsyncClient) -> MetricsScraper | None:
    api = deps.settings
    if api.scrape_interval_s <= 0:
        return None
    registry = deps.registry
    return MetricsScraper(
        deps.loads,
        http,
        lambda: [(r.id, r.url, r.model) for r in registry.replicas() if r.url],
        interval_s=api.scrape_interval_s,
        timeout_s=api.scrape_timeout_s,
    )


def serve_proxy(settings: IndexerSettings, api: ApiSettings, proxy: ProxySettings) -> None:
    """Run until interrupted. SIGINT/SIGTERM drain: no new connection is accepted, the
    requests being answered finish (``proxy.drain_timeout_s`` at most), then the read path
    stops."""
    if settings.store == "redis":
        deps = api_deps(settings.redis_url, settings, api)
        try:
            _run_uvicorn(build_proxy_app(deps, proxy), api, proxy)
        finally:
            deps.index.close()
        return
    service = Service.build(settings, api)
    service.indexer.start()
    try:
        _run_uvicorn(build_proxy_app(service.deps, proxy), api, proxy)
    finally:
        service.stop()


def _run_uvicorn(app: Starlette, api: ApiSettings, proxy: ProxySettings) -> None:
    # The replicas' own Date and Server headers are passed on: uvicorn adds none.
    run_app(
        app,
        api,
        server_header=False,
        date_header=False,
        timeout_graceful_shutdown=math.ceil(proxy.drain_timeout_s),  # uvicorn: whole seconds
    )
