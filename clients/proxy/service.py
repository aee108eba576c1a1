"""The ``kvindex proxy`` process: the read path (:mod:`kvindex.api.runtime`) and the proxy's
own parts (forwarder, breakers, reservations and their lease keeper), under uvicorn."""

from __future__ import annotations

import logging
import math
import shutil
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

from starlette.applications import Starlette

from kvindex.api.config.settings import ApiSettings, ReadPathSettings
from kvindex.api.health.ejection import EjectionMetrics, ReplicaBreakers
from kvindex.api.health.routing import health_policy
from kvindex.api.http.metrics import TimedIndex
from kvindex.api.http.server import Service, run_app
from kvindex.api.http.worker_scrape import WorkerScrape, private_directory
from kvindex.api.http.workers import Workers, bound_socket
from kvindex.api.load.desk import ReservationDesk
from kvindex.api.load.reservations import LeaseKeeper, Reservations
from kvindex.api.runtime import ApiDeps, Hooks, build_read_path, open_stores
from kvindex.clients.proxy.app import (
    ProxyParts,
    create_proxy_app,
    forwarded_endpoints,
    unparsed_request_body,
)
from kvindex.clients.proxy.forwarding import Forwarder
from kvindex.clients.proxy.front_protocol import front_protocol
from kvindex.clients.proxy.journal import ReceiptSink
from kvindex.clients.proxy.metrics import ProxyMetrics
from kvindex.clients.proxy.settings import ProxySettings
from kvindex.clients.proxy.upstream import UpstreamPicker
from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.fleet.discovery import start_discovery
from kvindex.indexer.fleet.replica_health import Ejection

_STOP_MARGIN_S = 10
"""After the drain, how long the read path's stop may take before a worker is killed."""

_LOG = logging.getLogger("kvindex.proxy")


def build_proxy_app(
    deps: ApiDeps,
    proxy: ProxySettings,
    worker: int = 0,
    sockets_dir: Path | None = None,
    receipts: ReceiptSink | None = None,
) -> Starlette:
    """The proxy's app on ``deps`` (the caller's stores); its parts live for its lifespan;
    ``worker``: which of ``proxy.workers`` processes serves it, their series shared through
    ``sockets_dir`` (:mod:`kvindex.api.http.worker_scrape`); ``receipts``: where the journal
    is shared."""
    api = deps.settings
    metrics = ProxyMetrics(worker)
    ejections = EjectionMetrics(metrics.registry, deps.registry, api)

    def ejected(replica: str, reason: Ejection) -> None:
        ejections.ejected(replica, reason)
        if reason is Ejection.HEALTH_CHECK:  # not answering: its waiting requests go elsewhere
            forwarder.abandon(replica, "ejected: failed health checks")

    def distrusted() -> frozenset[str]:  # ``parts`` is made below, before anything is scored
        return parts.verdicts.distrusted()

    hooks = Hooks(
        wrap_index=lambda index: TimedIndex(index, metrics.timed(metrics.lookup_latency)),
        on_ejected=ejected,
        on_check_stalled=ejections.check_stalled,
        distrusted=distrusted,
    )
    read_path = build_read_path(deps, hooks)
    metrics.watch_block_sizes(read_path.block_sizes)
    metrics.watch_tokenizers(read_path.tokenizers)
    if deps.runs_write_path:  # as `kvindex serve`: an indexer elsewhere exports its own
        metrics.watch_write_path(deps.registry, deps.index)
    picker = UpstreamPicker(
        read_path.scorer,
        deps.registry,
        on_tokenize_failure=lambda model: metrics.tokenize_failures.labels(model).inc(),
        lora_base=api.lora_base,
        health_policy=health_policy(api),
        explain=max(proxy.journal_candidates, proxy.max_attempts) if proxy.journal_entries else 0,
        head_first=proxy.head_first,
    )
    reservations = Reservations(
        deps.loads.ledger, proxy.lease_ttl_s, on_lost=metrics.reservations_lost.inc
    )
    desk = ReservationDesk(
        reservations,
        metrics.desk_series(),
        blocking=deps.blocking_store,
        log=logging.getLogger("kvindex.proxy"),
    )
    breakers = ReplicaBreakers(
        api, deps.registry, blocking_store=deps.blocking_store, on_ejected=ejections.ejected
    )
    read_path.health_checker.count_traffic(breakers.answered_within)
    forwarder = Forwarder(
        proxy,
        metrics,
        desk=desk,
        on_outcome=breakers.outcome,
        confirm_hang=read_path.health_checker.confirm_hang,
    )
    keeper = LeaseKeeper(
        reservations,
        blocking=deps.blocking_store,
        on_failure=metrics.reservation_failures.labels("renew").inc,
    )

    scrape = None
    if sockets_dir is not None:

        async def own() -> bytes:  # the write path's series read the index: off the loop
            return await read_path.off_loop(metrics.render, deps.registry.models())

        on_failure = metrics.worker_scrape_failures.inc
        scrape = WorkerScrape(sockets_dir, worker, proxy.workers, own, on_failure=on_failure)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await read_path.start()
        await keeper.start()
        if scrape is not None:
            await scrape.start()
        try:
            yield
        finally:
            if scrape is not None:
                await scrape.stop()
            await parts.journal.close()
            await keeper.stop()
            await desk.close()  # after the drain: what is still reserved is released
            await forwarder.close()
            await breakers.close()
            await read_path.stop()

    parts = ProxyParts(
        api,
        deps.registry,
        deps.index,
        picker,
        forwarder,
        metrics,
        read_path.off_loop,
        proxy=proxy,
        loads=deps.loads,
        block_sizes=read_path.block_sizes,
        scrape=scrape,
        receipts=receipts,
        tokenizers=read_path.tokenizers.tokenizer,
    )
    app = create_proxy_app(parts, lifespan)
    app.state.read_path = read_path
    return app


def serve_proxy(settings: IndexerSettings, api: ApiSettings, proxy: ProxySettings) -> None:
    """Run until SIGINT/SIGTERM, then drain: no new connection, requests finish (at most
    ``proxy.drain_timeout_s``), then the read path stops. With ``proxy.workers`` > 1 the
    port is bound once and each worker process serves it (:mod:`kvindex.api.http.workers`)."""
    if proxy.workers == 1:
        _serve_one(settings, api, proxy)
        return
    listening = bound_socket(api.host, api.port)
    sockets_dir = private_directory()

    def serve(worker: int) -> None:
        _serve_one(
            settings, api, proxy, worker=worker, sockets=[listening], sockets_dir=sockets_dir
        )

    grace_s = math.ceil(proxy.drain_timeout_s) + _STOP_MARGIN_S
    try:
        code = Workers(proxy.workers, serve, listening, grace_s=grace_s).run()
    finally:
        shutil.rmtree(sockets_dir, ignore_errors=True)
    if code:
        raise SystemExit(code)


def _serve_one(
    settings: IndexerSettings,
    api: ApiSettings,
    proxy: ProxySettings,
    *,
    worker: int = 0,
    sockets: list[socket.socket] | None = None,
    sockets_dir: Path | None = None,
) -> None:
    """One process's proxy: its stores (memory: its own subscriber and index), its app."""
    if settings.store == "redis":
        deps = open_stores(ReadPathSettings(settings, api))
        discovery = start_discovery(settings.discovery, deps.registry)
        receipts = _receipt_stream(settings, api, proxy)
        try:
            app = build_proxy_app(deps, proxy, worker, sockets_dir, receipts)
            _run_uvicorn(app, api, proxy, sockets)
        finally:
            if discovery is not None:
                discovery.stop()
            deps.loads.close()
        return
    service = Service.build(settings, api)
    service.indexer.start()
    try:
        _run_uvicorn(build_proxy_app(service.deps, proxy, worker, sockets_dir), api, proxy, sockets)
    finally:
        service.stop()


def _receipt_stream(
    settings: IndexerSettings, api: ApiSettings, proxy: ProxySettings
) -> ReceiptSink | None:
    """The journal's shared Stream on the Redis store, on its own bounded connection."""
    if not proxy.journal_entries or not proxy.journal_stream_maxlen:
        return None
    from kvindex.clients.proxy.receipt_stream import ReceiptStream  # noqa: PLC0415
    from kvindex.indexer.redis.connection import connect_bounded  # noqa: PLC0415

    client = connect_bounded(
        settings.redis_url, timeout_s=api.redis_timeout_s, cluster=settings.redis_cluster
    )
    return ReceiptStream(client, settings.redis_schema.receipts, proxy.journal_stream_maxlen)


def _run_uvicorn(
    app: Starlette,
    api: ApiSettings,
    proxy: ProxySettings,
    sockets: list[socket.socket] | None,
) -> None:
    # The replicas' own Date and Server headers are passed on: uvicorn adds none.
    forwarded = forwarded_endpoints(app)
    run_app(
        app,
        api,
        sockets=sockets,
        protocol=partial(front_protocol, front=forwarded, max_body_bytes=api.max_body_bytes),
        bad_request_body=unparsed_request_body,
        server_header=False,
        date_header=False,
        proxy_headers=False,  # the client is the peer: X-Forwarded-For is appended to, not read
        timeout_graceful_shutdown=math.ceil(proxy.drain_timeout_s),  # uvicorn: whole seconds
    )
