"""Assembles an indexer process from its settings: store, registry, subscriber, on Redis
the fleet sync that shares replicas and stream status with API processes, and, for
``kvindex indexer``, the status port (/metrics, /healthz, /readyz)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvindex.indexer.circuit import CircuitIndex, StoreCircuit
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.sync import FleetSync
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import BlockIndex
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.process_limits import raise_file_limit
from kvindex.indexer.redis_connection import connect
from kvindex.indexer.redis_schema import Schema
from kvindex.indexer.settings import IndexerSettings
from kvindex.indexer.status_server import IndexerStatus
from kvindex.indexer.subscriber import Subscriber

log = logging.getLogger("kvindex.indexer")


def _raise_file_limit(settings: IndexerSettings) -> None:
    """Raise the soft open-file limit as ``max_open_files`` says (logged when it moved)."""
    before, after = raise_file_limit(settings.max_open_files)
    if after.soft != before.soft:
        log.info("open-file limit raised from %s to %s", before, after)


def open_index(settings: IndexerSettings) -> BlockIndex:
    """The store the settings name: in-process (default) or Redis."""
    if settings.store == "redis":
        client = connect(settings.redis_url, cluster=settings.redis_cluster)
        return RedisIndex(client, Schema(settings.redis_prefix))
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
    status: IndexerStatus | None = None
    """The status port (``build(..., with_status=True)`` and ``status_port`` not -1)."""

    @classmethod
    def build(
        cls,
        settings: IndexerSettings,
        index: BlockIndex | None = None,
        *,
        with_status: bool = False,
    ) -> IndexerService:
        """The service the settings describe. ``with_status``: also serve the status port
        (the ``kvindex indexer`` process; a process that embeds the write path, such as
        ``kvindex serve``, exports its series its own way)."""
        _raise_file_limit(settings)  # before the subscriber sizes its context to it
        index = index if index is not None else open_index(settings)
        registry = Registry(settings.replicas, stale_after_s=settings.stale_after_s)
        fleet = None
        written: BlockIndex = index
        if isinstance(index, RedisIndex):
            fleet = FleetSync(index.client, index.schema, registry, declared=settings.replicas)
            circuit = StoreCircuit(settings.store_cooldown_s, name="redis (write path)")
            written = CircuitIndex(
                index, circuit
            )  # a down store costs one wait, not one per stream
        subscriber = Subscriber(settings, written, registry)
        service = cls(settings, index, registry, subscriber, fleet)
        if with_status and settings.status_port != -1:
            service.status = IndexerStatus.build(settings, registry, index, service.loop_alive)
        return service

    def start(self) -> None:
        """Open the status port first (a port in use fails here, before anything runs),
        then the fleet sync and the subscriber."""
        logging.getLogger("kvindex").setLevel(self.settings.log_level.upper())
        if self.status is not None:
            self.status.start()
        if self.fleet is not None:  # first: replicas added through the API open now too
            self.fleet.start()
        self.subscriber.start()

    def stop(self) -> None:
        if self.status is not None:
            self.status.stop()
        if self.fleet is not None:
            self.fleet.stop()
        self.subscriber.stop()
        self.index.close()

    def loop_alive(self) -> bool:
        """True while the subscriber's loop thread runs (started, not ended)."""
        return self.subscriber.running
