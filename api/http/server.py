"""Runs kvindex as a service: the indexer and the API in one process (``kvindex serve``),
or the API alone on a Redis an indexer writes (``kvindex api``, the production layout).

The in-process store is the default (one process, nothing else to install); with
``store = "redis"`` the index and the load both live in Redis, so several API processes
agree on both. An API-only process also reads the fleet (replicas, stream status) from
Redis through :class:`~kvindex.indexer.fleet.view.RedisFleetView`.

The API's Redis calls use a connection of their own (:func:`_bounded_stores`): every call
times out after ``api.redis_timeout_s``, and one
:class:`~kvindex.indexer.index.circuit.StoreCircuit` shared by the index, load and fleet reads
skips Redis for ``api.redis_cooldown_s`` after a failure. One circuit, because the three
share that connection and its server: the first call to find it down spares the others
the wait, and one probe per cool-down tells them all that it is back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import uvicorn

from kvindex.api.config.settings import ApiSettings
from kvindex.api.http.app import ApiDeps, create_app, hot_serving
from kvindex.api.http.hot_routes import HotServing
from kvindex.api.http.server_protocol import hot_protocol
from kvindex.api.load.store import CircuitLoadStore, LoadStore, MemoryLoadStore, RedisLoadStore
from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.fleet.registry import RegistryView
from kvindex.indexer.fleet.view import RedisFleetView
from kvindex.indexer.index.circuit import CircuitIndex, StoreCircuit
from kvindex.indexer.index.protocol import BlockIndex, IndexUnavailableError
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.redis.connection import connect_bounded
from kvindex.indexer.service import IndexerService

log = logging.getLogger("kvindex.api")


@dataclass
class Service:
    """A running indexer plus what the API needs next to it."""

    indexer: IndexerService
    loads: LoadStore
    deps: ApiDeps

    @classmethod
    def build(cls, settings: IndexerSettings, api: ApiSettings) -> Service:
        indexer = IndexerService.build(settings)
        index: BlockIndex = indexer.index
        loads: LoadStore = MemoryLoadStore()
        circuit: StoreCircuit | None = None
        if settings.store == "redis":
            # The API reads through its own bounded connection, not the write path's.
            index, loads, _, circuit = _bounded_stores(settings.redis_url, settings, api)
        deps = ApiDeps(
            settings=api,
            index=index,
            registry=indexer.registry,
            loads=loads,
            blocking_store=settings.store == "redis",
            runs_write_path=True,
            circuit=circuit,
        )
        return cls(indexer, loads, deps)

    def stop(self) -> None:
        self.indexer.stop()
        self.loads.close()


def _bounded_stores(
    redis_url: str, settings: IndexerSettings, api: ApiSettings
) -> tuple[BlockIndex, LoadStore, RegistryView, StoreCircuit]:
    """The API's index, load and fleet on one bounded connection, and their one circuit.

    The index's schema is checked here (:func:`_checked_index`): an index of another
    version or group count is refused at start, not answered as no match."""
    schema = settings.redis_schema
    client = connect_bounded(
        redis_url, timeout_s=api.redis_timeout_s, cluster=settings.redis_cluster
    )
    circuit = StoreCircuit(api.redis_cooldown_s)
    index = CircuitIndex(_checked_index(RedisIndex(client, schema)), circuit)
    loads = CircuitLoadStore(RedisLoadStore(client, schema), circuit)
    fleet = RedisFleetView(client, schema, stale_after_s=settings.stale_after_s, circuit=circuit)
    return index, loads, fleet, circuit


def _checked_index(index: RedisIndex) -> RedisIndex:
    """``index`` once :meth:`RedisIndex.check_schema` passed; raises
    :class:`~kvindex.indexer.redis.schema.SchemaVersionError` when the Redis holds index
    data this process would not read. A Redis down at start is not an error (the API
    answers degraded meanwhile): the index then checks at its first lookup."""
    try:
        index.check_schema()
    except IndexUnavailableError as exc:
        log.warning("redis unreachable at start, its index is checked when it answers: %s", exc)
    return index


def api_deps(redis_url: str, settings: IndexerSettings, api: ApiSettings) -> ApiDeps:
    """An API-only process's deps: Redis index, Redis load, Redis fleet view (one client,
    one circuit). It runs no write path, so its /metrics leaves the fleet's write-path
    series to the indexer's port (exported once, however many API processes there are)."""
    index, loads, fleet, circuit = _bounded_stores(redis_url, settings, api)
    return ApiDeps(
        settings=api,
        index=index,
        registry=fleet,
        loads=loads,
        blocking_store=True,
        runs_write_path=False,
        circuit=circuit,
    )


def serve(
    settings: IndexerSettings,
    api: ApiSettings,
    watch: Callable[[IndexerService], AbstractContextManager[object]] | None = None,
) -> None:
    """Run until interrupted (SIGINT/SIGTERM stop uvicorn, then everything else).

    ``watch(indexer)``, if given, is entered once the indexer has started and left when
    uvicorn stops (the CLI's periodic status line)."""
    service = Service.build(settings, api)
    service.indexer.start()
    try:
        with watch(service.indexer) if watch is not None else nullcontext():
            _run_uvicorn(service.deps, api)
    finally:
        service.stop()


def serve_api(redis_url: str, settings: IndexerSettings, api: ApiSettings) -> None:
    """Run the API alone on a shared Redis until interrupted."""
    deps = api_deps(redis_url, settings, api)
    try:
        _run_uvicorn(deps, api)
    finally:
        deps.index.close()


class GracefulServer(uvicorn.Server):
    """uvicorn's server, except that the SIGTERM or SIGINT that stopped it is not raised
    again once it has: uvicorn re-raises it, so the process died of it at once and its
    caller's cleanup (the indexer's threads, the store's connections) never ran. The
    process then ends as its caller returns (exit status 0)."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()


def _run_uvicorn(deps: ApiDeps, api: ApiSettings) -> None:
    app = create_app(deps)
    run_app(app, api, hot=hot_serving(app))


def run_app(app: Any, api: ApiSettings, *, hot: HotServing | None = None, **options: Any) -> None:
    """Serve ``app`` on ``api.host:api.port`` until SIGINT/SIGTERM, as every kvindex HTTP
    process does: request heads within ``api.header_timeout_s``, the signal not re-raised
    (:class:`GracefulServer`), ``hot``'s routes answered by the server's protocol itself
    (:mod:`kvindex.api.http.server_protocol`); ``options`` are further ``uvicorn.Config``
    arguments."""
    # log_config=None: uvicorn's loggers keep no handlers of their own and propagate to the
    # process's (its format, JSON or text, and its repeat filter); its access log stays off,
    # the app's own (``api.access_log``) labels requests by route.
    config = uvicorn.Config(
        app,
        host=api.host,
        port=api.port,
        log_level="warning",
        access_log=False,
        log_config=None,
        http=hot_protocol(api.header_timeout_s, hot),
        **options,
    )
    GracefulServer(config).run()
