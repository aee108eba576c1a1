"""Runs kvindex as a service: indexer and API in one process (``kvindex serve``), or the API
alone on a Redis an indexer writes (``kvindex api``); each runs until SIGINT/SIGTERM."""

from __future__ import annotations

import gc
import socket
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import msgspec
import uvicorn

from kvindex.api.config.settings import ApiSettings, ReadPathSettings
from kvindex.api.http.allocator import pin_allocator
from kvindex.api.http.core import ApiCore
from kvindex.api.http.deferred_app import DeferredApp
from kvindex.api.http.hot_routes import HotServing
from kvindex.api.http.server_protocol import HotProtocol, hot_protocol
from kvindex.api.http.traffic import TrafficObserver
from kvindex.api.runtime import ApiDeps, open_stores
from kvindex.api.schemas import ErrorBody
from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.domain.errors import SettingsError
from kvindex.indexer.index.block_journal import BlockJournal, JournaledIndex
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import BlockIndex
from kvindex.indexer.service import IndexerService


@dataclass
class Service:
    """``kvindex serve``'s indexer and the read path's stores on it; :meth:`stop` stops both."""

    indexer: IndexerService
    deps: ApiDeps

    @classmethod
    def build(cls, settings: IndexerSettings, api: ApiSettings) -> Service:
        indexer = IndexerService.build(settings, dump_index(settings, api))
        return cls(indexer, open_stores(ReadPathSettings(settings, api), writer=indexer))

    def stop(self) -> None:
        self.indexer.stop()
        self.deps.loads.close()


def dump_index(settings: IndexerSettings, api: ApiSettings) -> BlockIndex | None:
    """With ``api.dynamo_dump``, the memory index kept with a journal (None: the default)."""
    if not api.dynamo_dump:
        return None
    if settings.store != "memory":
        raise SettingsError("api.dynamo_dump needs the memory store (kvindex serve)")
    return JournaledIndex(MemoryIndex(), BlockJournal())


def serve(
    settings: IndexerSettings,
    api: ApiSettings,
    watch: Callable[[IndexerService], AbstractContextManager[object]] | None = None,
) -> None:
    service = Service.build(settings, api)
    service.indexer.start()
    try:
        with watch(service.indexer) if watch is not None else nullcontext():
            _run_uvicorn(service.deps, api)
    finally:
        service.stop()


def serve_api(settings: ReadPathSettings) -> None:
    if settings.api.dynamo_dump:
        raise SettingsError("api.dynamo_dump: the API process keeps no journal (kvindex serve)")
    deps = open_stores(settings)
    try:
        _run_uvicorn(deps, settings.api)
    finally:
        deps.loads.close()


GC_THRESHOLDS = (10_000, 20, 20)
"""The collector's thresholds once a server listens (Python's are 700, 10, 10): a request
allocates hundreds of containers that die by reference count, so the young generation is
walked every few requests at the defaults, and the kept ones (journals, caches, the index)
are walked again by every older round. Cycles wait longer to be freed, bounded the same way."""


class GracefulServer(uvicorn.Server):
    """uvicorn's server, without re-raising the signal that stopped it (so cleanup runs), its
    start-up's objects out of the garbage collector's rounds once it listens."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # What start-up built (modules, settings, the app) lives as long as the process:
        # frozen, a collection no longer walks it (a forked worker no longer copies its pages).
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()


def _run_uvicorn(deps: ApiDeps, api: ApiSettings) -> None:
    app, hot = served_app(deps)
    run_app(app, api, hot=hot)


def served_app(deps: ApiDeps) -> tuple[DeferredApp, HotServing]:
    """The app ``kvindex serve`` and ``kvindex api`` run, and the hot routes their protocol
    answers (counted as the app counts its requests)."""
    core = ApiCore(deps)
    app = DeferredApp(core)
    traffic = TrafficObserver(app, metrics=core.metrics, access_log=deps.settings.access_log)
    return app, core.hot_serving(traffic)


def api_bad_request(message: str) -> bytes:
    """The API's error body (:class:`ErrorBody`) for a request the HTTP parser refuses."""
    return msgspec.json.encode(ErrorBody("invalid_request", message))


def run_app(
    app: Any,
    api: ApiSettings,
    *,
    hot: HotServing | None = None,
    sockets: list[socket.socket] | None = None,
    bad_request_body: Callable[[str], bytes] = api_bad_request,
    protocol: Callable[[type[HotProtocol]], type[HotProtocol]] | None = None,
    **options: Any,
) -> None:
    """Serve ``app`` on ``api.host:api.port`` (or on ``sockets``, bound already: a worker's)
    until SIGINT/SIGTERM, with the head deadline, the lingering close and ``hot``'s routes
    in the protocol, a request the parser refuses answered 400 with ``bad_request_body``;
    ``protocol`` makes the protocol class from that one; ``options`` go to ``uvicorn.Config``."""
    pin_allocator()
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
        ws="none",  # kvindex speaks no WebSocket: every Upgrade is ignored (request_head)
        http=(protocol or _same)(
            hot_protocol(
                api.header_timeout_s,
                hot,
                linger_s=api.body_timeout_s,
                bad_request_body=bad_request_body,
            )
        ),
        **options,
    )
    GracefulServer(config).run(sockets=sockets)


def _same(protocol: type[HotProtocol]) -> type[HotProtocol]:
    return protocol
