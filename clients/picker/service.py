"""The ``kvindex picker`` process: the read path, the ext_proc and gRPC health services on one
port, ``/metrics``, ``/healthz`` and ``/readyz`` on another."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from kvindex.api.config.settings import ApiSettings, ReadPathSettings
from kvindex.api.health.ejection import ReplicaBreakers
from kvindex.api.health.routing import health_policy
from kvindex.api.http.metrics import TimedIndex, TokenizerCollector
from kvindex.api.http.server import Service
from kvindex.api.load.desk import ReservationDesk
from kvindex.api.load.reservations import LeaseKeeper, Reservations
from kvindex.api.runtime import ApiDeps, Hooks, ReadPath, build_read_path, open_stores
from kvindex.clients.picker.admission import Admission
from kvindex.clients.picker.decision import EndpointChooser
from kvindex.clients.picker.exchange import Exchange
from kvindex.clients.picker.metrics import PickerMetrics
from kvindex.clients.picker.servicer import ExtProcServicer
from kvindex.clients.picker.settings import PickerSettings
from kvindex.clients.proxy.upstream import UpstreamPicker
from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.fleet.discovery import start_discovery
from kvindex.indexer.fleet.registry import RegistryView
from kvindex.indexer.status_server import Check, StatusServer, status_routes

logger = logging.getLogger("kvindex.picker")
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
"""The gRPC health services answered (GIE's picker names the last three)."""


@dataclass
class Picker:
    """One picker's parts on its stores; :meth:`start` and :meth:`stop` run on its loop."""

    deps: ApiDeps
    settings: PickerSettings
    metrics: PickerMetrics
    read_path: ReadPath
    chooser: EndpointChooser
    admission: Admission
    keeper: LeaseKeeper
    breakers: ReplicaBreakers
    """When each replica last answered: a health check passes on that (its failures are
    the gateway's to act on)."""
    serving: bool = False
    """The ext_proc service answers (``/readyz`` says so)."""

    def exchange(self) -> Exchange:
        return Exchange(
            self.chooser.choose,
            self.admission,
            self.metrics,
            max_body_bytes=self.deps.settings.max_body_bytes,
            on_answered=self._answered,
        )

    def _answered(self, replica: str) -> None:
        self.breakers.outcome(replica, True, "answered through the gateway")

    async def start(self) -> None:
        await self.read_path.start()
        await self.keeper.start()

    async def stop(self) -> None:
        await self.keeper.stop()
        await self.admission.close()
        await self.breakers.close()
        await self.read_path.stop()


def build_picker(deps: ApiDeps, settings: PickerSettings) -> Picker:
    """The picker on ``deps`` (the caller's stores)."""
    api = deps.settings
    metrics = PickerMetrics()
    hooks = Hooks(
        wrap_index=lambda index: TimedIndex(index, metrics.lookup_latency),
    )
    read_path = build_read_path(deps, hooks)
    metrics.registry.register(TokenizerCollector(read_path.tokenizers))
    policy = health_policy(api)

    def upstreams_over(registry: RegistryView) -> UpstreamPicker:
        return UpstreamPicker(
            read_path.scorer,
            registry,
            lora_base=api.lora_base,
            health_policy=policy,
            head_first=settings.head_first,
        )

    chooser = EndpointChooser(
        upstreams_over, deps.registry, num_endpoints=settings.num_endpoints, health_policy=policy
    )
    reservations = Reservations(deps.loads.ledger, settings.lease_ttl_s)
    desk = ReservationDesk(
        reservations, metrics.desk_series(), blocking=deps.blocking_store, log=logger
    )
    admission = Admission(desk, max_in_flight=settings.max_in_flight)
    keeper = LeaseKeeper(
        reservations,
        blocking=deps.blocking_store,
        on_failure=metrics.reservation_failures.labels("renew").inc,
    )
    breakers = ReplicaBreakers(api, deps.registry, blocking_store=deps.blocking_store)
    read_path.health_checker.count_traffic(breakers.answered_within)
    return Picker(deps, settings, metrics, read_path, chooser, admission, keeper, breakers)


async def run_picker(picker: Picker, host: str, stopping: asyncio.Event) -> None:
    """Serve until ``stopping`` is set, then drain (at most ``drain_timeout_s``) and stop."""
    # A buffered body comes in one message: room for the largest body and its framing.
    size = picker.deps.settings.max_body_bytes + 2**20
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", size)])
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
        ExtProcServicer(picker.exchange, picker.admission), server
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = (
        f"[{host}]:{picker.settings.port}" if ":" in host else f"{host}:{picker.settings.port}"
    )
    if not server.add_insecure_port(address):
        raise OSError(f"cannot listen on {address}")
    await picker.start()
    await server.start()
    for service in HEALTH_SERVICES:
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    picker.serving = True
    logger.info("picker serving ext_proc on %s", address)
    try:
        await stopping.wait()
    finally:
        picker.serving = False
        for service in HEALTH_SERVICES:
            await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.stop(picker.settings.drain_timeout_s)
        await picker.stop()


def status_server(picker: Picker, host: str) -> StatusServer | None:
    """``/metrics``, ``/healthz``, ``/readyz`` on the metrics port (None: ``metrics_port`` -1)."""
    if picker.settings.metrics_port < 0:
        return None
    registry: CollectorRegistry = picker.metrics.registry
    routes = status_routes(registry, lambda: Check(True), lambda: _readiness(picker))
    return StatusServer(host, picker.settings.metrics_port, routes)


def _readiness(picker: Picker) -> Check:
    return Check(True) if picker.serving else Check(False, ("ext_proc not serving",))


def serve_picker(settings: IndexerSettings, api: ApiSettings, picker: PickerSettings) -> None:
    """Run until SIGINT/SIGTERM: the memory store runs its own indexer here; Redis is read."""
    if settings.store == "redis":
        deps = open_stores(ReadPathSettings(settings, api))
        discovery = start_discovery(settings.discovery, deps.registry)
        try:
            _serve(build_picker(deps, picker), api.host)
        finally:
            if discovery is not None:
                discovery.stop()
            deps.loads.close()
        return
    service = Service.build(settings, api)
    service.indexer.start()
    try:
        _serve(build_picker(service.deps, picker), api.host)
    finally:
        service.stop()


def _serve(picker: Picker, host: str) -> None:
    status = status_server(picker, host)
    if status is not None:
        status.start()
    try:
        asyncio.run(_until_signal(picker, host))
    finally:
        if status is not None:
            status.stop()


async def _until_signal(picker: Picker, host: str) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    stop: Callable[[], None] = stopping.set
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop)
    await run_picker(picker, host, stopping)
