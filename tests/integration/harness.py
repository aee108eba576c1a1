"""Building blocks for write-path integration tests: publishers, an indexer, waiting."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import zmq

from kvindex.clients.fake_vllm.publisher import EventPublisher
from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.fleet.registry import Freshness, StreamStatus
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.protocol import BlockIndex
from kvindex.indexer.ingest.wire import Encoding, ReplayLayout
from kvindex.indexer.service import IndexerService
from tests.support.redis_server import free_ports

MODEL = "demo-model"


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what or predicate}")


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def publisher_at(
    port: int | None,
    replay_port: int | None,
    *,
    topic: str = f"kv@r1@{MODEL}",
    rank: int = 0,
    encoding: Encoding = "map",
    replay_layout: ReplayLayout = "topic",
    buffer_steps: int = 10_000,
    replay: bool = True,
) -> EventPublisher:
    """A publisher bound on loopback (given ports, or free ones), retrying a busy port."""
    endpoint = f"tcp://127.0.0.1:{port or '*'}"
    replay_endpoint = f"tcp://127.0.0.1:{replay_port or '*'}" if replay else None
    deadline = time.monotonic() + 5
    while True:
        try:
            return EventPublisher(
                endpoint,
                replay_endpoint,
                topic=topic,
                rank=rank,
                encoding=encoding,
                replay_layout=replay_layout,
                buffer_steps=buffer_steps,
                bind=True,
            )
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@dataclass
class Indexer:
    service: IndexerService

    @property
    def index(self) -> BlockIndex:
        return self.service.index

    def status(self, stream: StreamId) -> StreamStatus:
        status = self.service.registry.status(stream)
        assert status is not None, f"no status for {stream}"
        return status

    def applied(self, stream: StreamId, seq: int) -> Callable[[], bool]:
        def check() -> bool:
            status = self.service.registry.status(stream)
            return (
                status is not None
                and status.health.last_seq >= seq
                and status.freshness is not Freshness.REPLAYING
            )

        return check


@contextmanager
def running_indexer(settings: IndexerSettings, index: BlockIndex) -> Iterator[Indexer]:
    service = IndexerService.build(settings, index)
    service.start()
    try:
        yield Indexer(service)
    finally:
        service.stop()


def replica_of(pub: EventPublisher, replica: str = "r1", dp_size: int = 1) -> ReplicaSpec:
    return ReplicaSpec(
        id=replica, model=MODEL, events=pub.endpoint, replay=pub.replay_endpoint, dp_size=dp_size
    )


def settings_for(*replicas: ReplicaSpec, **changes: object) -> IndexerSettings:
    base: dict[str, object] = {"replay_timeout_s": 2.0, "reconnect_max_s": 0.2}
    base.update(changes)
    return IndexerSettings(replicas=tuple(replicas), **base)  # type: ignore[arg-type]


def warm_up(ix: Indexer, pub: EventPublisher, stream: StreamId) -> None:
    """Wait until the stream is connected, synced and receiving live (slow joiner): after
    this, a published batch arrives live, so counters measure only what the test does."""

    def connected() -> bool:
        status = ix.service.registry.status(stream)
        return status is not None and status.health.connected

    wait_until(connected, what=f"{stream} connected")
    _first_batch_applied(ix, pub, stream)
    probe = ix.status(stream).health.num_replays
    seq = pub.publish([])
    wait_until(ix.applied(stream, seq), what=f"{stream} live")
    assert ix.status(stream).health.num_replays == probe, "warm-up batch was not live"


def _first_batch_applied(ix: Indexer, pub: EventPublisher, stream: StreamId) -> None:
    """Empty batches published until one is applied: a subscription that has just joined
    may miss the first (slow joiner), which nothing recovers without a replay endpoint."""
    deadline = time.monotonic() + 10.0
    while True:
        seq = pub.publish([])
        try:
            wait_until(ix.applied(stream, seq), timeout_s=0.5, what=f"{stream} warm-up batch")
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise


def consecutive_free_ports(count: int = 2, attempts: int = 50) -> int:
    """A base port p with p .. p+count-1 all free on loopback and handed out (data-parallel
    rank r uses base + r, as vLLM does)."""
    for _ in range(attempts):
        ports = free_ports(count)  # in turn from this process's share: mostly a run
        if ports == list(range(ports[0], ports[0] + count)):
            return ports[0]
    raise RuntimeError("no run of consecutive free loopback ports found")
