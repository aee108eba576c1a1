"""Assembles an indexer process from its settings: store, registry, subscriber; on Redis the
fleet sync and, sharded, the lease; for ``kvindex indexer``, the status port."""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import BlockIndex
from kvindex.indexer.ingest.process_limits import raise_file_limit
from kvindex.indexer.ingest.subscriber import Subscriber

if TYPE_CHECKING:  # imported where used: a memory-store `serve` loads no Redis client
    from kvindex.indexer.fleet.discovery import Discovery, DiscoveryCounts
    from kvindex.indexer.fleet.registry import RegistryView
    from kvindex.indexer.fleet.sync import FleetSync
    from kvindex.indexer.index.redis import RedisIndex
    from kvindex.indexer.ingest.membership import Membership, Shard
    from kvindex.indexer.status_server import IndexerStatus

log = logging.getLogger("kvindex.indexer")


def _raise_file_limit(settings: IndexerSettings) -> None:
    before, after = raise_file_limit(settings.max_open_files)
    if after.soft != before.soft:
        log.info("open-file limit raised from %s to %s", before, after)


def open_index(settings: IndexerSettings, *, owner: str | None = None) -> BlockIndex:
    """The store the settings name (``owner``: the lease token fencing its writes)."""
    if settings.store == "redis":
        from kvindex.indexer.index.redis import RedisIndex  # noqa: PLC0415
        from kvindex.indexer.redis.connection import connect  # noqa: PLC0415

        client = connect(settings.redis_url, cluster=settings.redis_cluster)
        return RedisIndex(client, settings.redis_schema, owner=owner)
    return MemoryIndex()


def indexer_id(settings: IndexerSettings) -> str:
    """``indexer_id``, or the host name (not the pid: restarted on its host, an indexer
    takes its streams back at once instead of waiting for its dead lease)."""
    if settings.indexer_id:
        return settings.indexer_id
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())
    return host or f"pid-{os.getpid()}"


def _membership(
    settings: IndexerSettings, index: BlockIndex | None
) -> tuple[BlockIndex, Membership | None]:
    if not settings.sharded or index is not None:
        return (index if index is not None else open_index(settings)), None
    from kvindex.indexer.index.redis import RedisIndex  # noqa: PLC0415
    from kvindex.indexer.ingest.membership import Membership  # noqa: PLC0415
    from kvindex.indexer.redis.connection import connect  # noqa: PLC0415

    client = connect(settings.redis_url, cluster=settings.redis_cluster)
    schema = settings.redis_schema
    membership = Membership(client, schema, indexer_id(settings), lease_ttl_s=settings.lease_ttl_s)
    return RedisIndex(client, schema, owner=membership.token), membership


def _redis_index(index: BlockIndex) -> RedisIndex | None:
    """``index`` if it is a :class:`RedisIndex` (whose module a memory store never loads)."""
    module = sys.modules.get("kvindex.indexer.index.redis")
    redis_index: RedisIndex | None = None
    if module is not None and isinstance(index, module.RedisIndex):
        redis_index = index
    return redis_index


def _redis_write_path(
    settings: IndexerSettings,
    index: RedisIndex,
    registry: Registry,
    membership: Membership | None,
) -> tuple[FleetSync, Shard | None, BlockIndex]:
    """The fleet sync, the shard (if sharded) and the index the subscriber writes, behind the
    write path's circuit: a down store costs one wait, not one per stream."""
    from kvindex.indexer.fleet.sync import FleetSync  # noqa: PLC0415
    from kvindex.indexer.index.circuit import CircuitIndex, StoreCircuit  # noqa: PLC0415
    from kvindex.indexer.ingest.membership import Shard  # noqa: PLC0415

    owner = None if membership is None else membership.member_id
    lease = None if membership is None else (lambda: membership.token)
    fleet = FleetSync(
        index.client, index.schema, registry, declared=settings.replicas, owner=owner, lease=lease
    )
    circuit = StoreCircuit(settings.store_cooldown_s, name="redis (write path)")
    shard = None if membership is None else Shard(membership, index, circuit)
    return fleet, shard, CircuitIndex(index, circuit)


def _fleet_view(index: RedisIndex) -> RegistryView:
    """On Redis, discovery changes the shared fleet (as ``POST /replicas`` does): the fleet
    sync brings each change into this registry, and every other process sees it."""
    from kvindex.indexer.fleet.view import RedisFleetView  # noqa: PLC0415

    return RedisFleetView(index.client, index.schema)


@dataclass
class IndexerService:
    """A running write path. ``start`` opens sockets; ``stop`` closes everything."""

    settings: IndexerSettings
    index: BlockIndex
    registry: Registry
    subscriber: Subscriber
    fleet: FleetSync | None = None
    status: IndexerStatus | None = None
    shard: Shard | None = None
    discovery: Discovery | None = None
    _discovered: RegistryView | None = None  # where discovery writes (None: no discovery)

    @classmethod
    def build(
        cls,
        settings: IndexerSettings,
        index: BlockIndex | None = None,
        *,
        with_status: bool = False,
    ) -> IndexerService:
        """The service the settings describe; ``with_status``: also the status port."""
        _raise_file_limit(settings)  # before the subscriber sizes its context to it
        index, membership = _membership(settings, index)
        registry = Registry(settings.replicas, stale_after_s=settings.stale_after_s)
        fleet, shard, written = None, None, index
        redis_index = _redis_index(index)
        if redis_index is not None:
            fleet, shard, written = _redis_write_path(settings, redis_index, registry, membership)
        subscriber = Subscriber(settings, written, registry, shard=shard)
        service = cls(settings, index, registry, subscriber, fleet, shard=shard)
        if settings.discovery.enabled:
            service._discovered = registry if redis_index is None else _fleet_view(redis_index)
        if with_status and settings.status_port != -1:
            from kvindex.indexer.status_server import IndexerStatus  # noqa: PLC0415

            service.status = IndexerStatus.build(
                settings, registry, index, service.loop_alive, service.discovered
            )
        return service

    def discovered(self) -> DiscoveryCounts | None:
        return None if self.discovery is None else self.discovery.counts()

    def start(self) -> None:
        """Open the status port first (a port in use fails before anything runs), then the
        fleet sync and the subscriber."""
        logging.getLogger("kvindex").setLevel(self.settings.log_level.upper())
        if self.status is not None:
            self.status.start()
        if self.fleet is not None:  # first: replicas added through the API open now too
            self.fleet.start()
        if self.shard is not None:  # the lease first: the streams owned open at start
            self.shard.tick()
            log.info("sharded indexer %s (lease %s)", self.shard.member_id, self.shard.token)
        self.subscriber.start()
        if self._discovered is not None:
            from kvindex.indexer.fleet.discovery import start_discovery  # noqa: PLC0415

            self.discovery = start_discovery(self.settings.discovery, self._discovered)

    def stop(self) -> None:
        if self.discovery is not None:
            self.discovery.stop()
        if self.status is not None:
            self.status.stop()
        if self.fleet is not None:
            self.fleet.stop()
        self.subscriber.stop()
        if self.shard is not None:
            self.shard.leave()  # after the last write: the others take over at once
        self.index.close()

    def loop_alive(self) -> bool:
        return self.subscriber.running
