"""Runs kvindex as a service: the indexer and the API in one process (``kvindex serve``).

The in-process store is the default (one process, nothing else to install); with
``store = "redis"`` the index and the load both live in Redis, so several API processes
agree on both.
"""

from __future__ import annotations

from dataclasses import dataclass

import uvicorn

from api.app import ApiDeps, create_app
from api.load import LoadStore, MemoryLoadStore, RedisLoadStore
from api.settings import ApiSettings
from indexer.redis_schema import Schema
from indexer.redis_store import RedisIndex
from indexer.service import IndexerService
from indexer.settings import IndexerSettings


@dataclass
class Service:
    """A running indexer plus what the API needs next to it."""

    indexer: IndexerService
    loads: LoadStore
    deps: ApiDeps

    @classmethod
    def build(cls, settings: IndexerSettings, api: ApiSettings) -> Service:
        indexer = IndexerService.build(settings)
        loads = _load_store(settings, indexer)
        deps = ApiDeps(
            settings=api,
            index=indexer.index,
            registry=indexer.registry,
            loads=loads,
            blocking_store=settings.store == "redis",
        )
        return cls(indexer, loads, deps)

    def stop(self) -> None:
        self.indexer.stop()
        self.loads.close()


def _load_store(settings: IndexerSettings, indexer: IndexerService) -> LoadStore:
    if settings.store == "redis" and isinstance(indexer.index, RedisIndex):
        return RedisLoadStore(indexer.index.client, Schema(settings.redis_prefix))
    return MemoryLoadStore()


def serve(settings: IndexerSettings, api: ApiSettings) -> None:
    """Run until interrupted (SIGINT/SIGTERM stop uvicorn, then everything else)."""
    service = Service.build(settings, api)
    service.indexer.start()
    try:
        app = create_app(service.deps)
        config = uvicorn.Config(
            app, host=api.host, port=api.port, log_level="warning", access_log=False
        )
        uvicorn.Server(config).run()
    finally:
        service.stop()
