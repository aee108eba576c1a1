"""Assembles an indexer process from its settings: store, registry, subscriber and, on
Redis, the fleet sync that shares replicas and stream status with API processes."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.sync import FleetSync
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import BlockIndex
from kvindex.indexer.index.redis import RedisIndex, connect
from kvindex.indexer.redis_schema import Schema
from kvindex.indexer.settings import IndexerSettings
from kvindex.indexer.subscriber import Subscriber


def open_index(settings: IndexerSettings) -> BlockIndex:
    """The store the settings name: in-process (default) or Redis."""
    if settings.store == "redis":
        return RedisIndex(connect(settings.redis_url), Schema(settings.redis_prefix))
    return MemoryIndex()


@dataclass
class IndexerService:
    """A running write path. ``start`` opens sockets; ``stop`` closes everything."""

    settings: IndexerSettings
    index: BlockIndex
    registry: Registry
    subscriber: Subscriber
    fleet: FleetSync | None = None
    """Publishes the fleet state to Redis (``store = "redis"`` only)."""

    @classmethod
    def build(cls, settings: IndexerSettings, index: BlockIndex | None = None) -> IndexerService:
        index = index if index is not None else open_index(settings)
        registry = Registry(settings.replicas, stale_after_s=settings.stale_after_s)
        fleet = None
        if isinstance(index, RedisIndex):
            fleet = FleetSync(index.client, index.schema, registry, declared=settings.replicas)
        return cls(settings, index, registry, Subscriber(settings, index, registry), fleet)

    def start(self) -> None:
        logging.getLogger("kvindex").setLevel(self.settings.log_level.upper())
        if self.fleet is not None:  # first: replicas added through the API open now too
            self.fleet.start()
        self.subscriber.start()

    def stop(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()
        self.subscriber.stop()
        self.index.close()
