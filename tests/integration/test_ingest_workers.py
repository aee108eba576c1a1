"""Ingest workers (``ingest_workers``) over real ZeroMQ into the memory store: every stream
on one worker, each stream's batches in order, a replay on one worker while another keeps
ingesting, a worker that dies restarted with its stream resynced."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq

from kvindex.clients.fake_vllm.publisher import EventPublisher
from kvindex.indexer.domain.events import BlockStored, Event, StreamId, Tier
from kvindex.indexer.domain.keys import block_keys
from kvindex.indexer.fleet.registry import Freshness
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.ingest.subscriber import SubscriberLoop
from kvindex.indexer.ingest.wire import encode_batch, encode_replay_end, encode_replay_reply
from tests.integration.harness import (
    MODEL,
    Indexer,
    publisher_at,
    replica_of,
    running_indexer,
    settings_for,
    wait_until,
    warm_up,
)

BLOCK = 16
NUM_BATCHES = 12
"""Batches of one chain each stream publishes: batch i stores block i, its parent block
i - 1, so a batch applied out of order would be an orphan and break the match."""

pytestmark = pytest.mark.timeout(60)


def tokens_of(replica: int) -> list[int]:
    """The stream's own token ids (no two streams share a block)."""
    return list(range(replica * 100_000, replica * 100_000 + NUM_BATCHES * BLOCK))


def hash_of(replica: int, block: int) -> int:
    return (replica + 1) * 1_000 + block


def chain_batch(replica: int, block: int) -> list[Event]:
    """Block ``block`` of the replica's chain, its parent the block before."""
    tokens = tokens_of(replica)[block * BLOCK : (block + 1) * BLOCK]
    parent = hash_of(replica, block - 1) if block else None
    return [BlockStored((hash_of(replica, block),), parent, tokens, BLOCK, Tier.GPU)]


def matched(index: MemoryIndex, replica: int, stream: StreamId) -> int:
    keys = block_keys(MODEL, tokens_of(replica), BLOCK)
    return index.longest_prefix(keys, [stream])[stream].num_blocks


@contextmanager
def publishers(count: int) -> Iterator[list[EventPublisher]]:
    pubs = [publisher_at(None, None, topic=f"kv@r{i}@{MODEL}") for i in range(count)]
    try:
        yield pubs
    finally:
        for pub in pubs:
            pub.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_every_stream_is_indexed_whole_and_in_order_by_one_worker(workers: int) -> None:
    index = MemoryIndex()
    with publishers(6) as pubs:
        specs = [replica_of(pub, f"r{i}") for i, pub in enumerate(pubs)]
        with running_indexer(settings_for(*specs, ingest_workers=workers), index) as ix:
            subscriber = ix.service.subscriber
            assert len(subscriber.loops) == workers and subscriber.running
            streams = [StreamId(f"r{i}") for i in range(len(pubs))]
            for pub, stream in zip(pubs, streams, strict=True):
                warm_up(ix, pub, stream)
            last = [0] * len(pubs)
            for block in range(NUM_BATCHES):  # interleaved: every stream busy at once
                for i, pub in enumerate(pubs):
                    last[i] = pub.publish(chain_batch(i, block))
            for stream, seq in zip(streams, last, strict=True):
                wait_until(ix.applied(stream, seq), what=f"{stream} applied")
            owners = {subscriber.worker_of(stream) for stream in streams}
            assert owners == set(range(workers))  # the streams are shared out
            for i, stream in enumerate(streams):
                health = ix.status(stream).health
                assert matched(index, i, stream) == NUM_BATCHES, stream
                assert (health.num_orphan_stores, health.num_gaps) == (0, 0)
                assert index.stats(stream).watermark == last[i]
                kept_by = [p for p in subscriber.pipelines if stream in p._runtimes]
                assert len(kept_by) == 1  # one pipeline keeps it: one worker applies it
                assert kept_by[0] is subscriber.loops[subscriber.worker_of(stream)].pipeline


class HeldReplay:
    """A replay ROUTER the test answers by hand: a replay asked of it stays open (the
    stream replaying) until :meth:`answer`."""

    def __init__(self, topic: bytes) -> None:
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind("tcp://127.0.0.1:*")
        self.endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic

    def request(self, timeout_s: float = 10.0) -> tuple[bytes, int]:
        """The next replay request: (identity, start seq)."""
        assert self._router.poll(int(timeout_s * 1000)), "no replay asked"
        identity, _, start = self._router.recv_multipart()
        return identity, int.from_bytes(start, "big")

    def answer(self, identity: bytes, batches: list[tuple[int, bytes]]) -> None:
        for seq, payload in batches:
            reply = encode_replay_reply(seq, payload, topic=self._topic, layout="topic")
            self._router.send_multipart([identity, b"", *reply])
        self._router.send_multipart([identity, b"", *encode_replay_end("topic")])

    def close(self) -> None:
        self._router.close(linger=0)
        self._context.term()


def test_a_replay_on_one_worker_while_the_other_keeps_ingesting() -> None:
    index = MemoryIndex()
    held = HeldReplay(f"kv@r0@{MODEL}".encode())
    with publishers(2) as pubs:
        specs = [
            ReplicaSpec("r0", MODEL, events=pubs[0].endpoint, replay=held.endpoint),
            replica_of(pubs[1], "r1"),
        ]
        try:
            with running_indexer(settings_for(*specs, ingest_workers=2), index) as ix:
                _replay_while_the_other_ingests(ix, index, held, pubs)
        finally:
            held.close()


def _replay_while_the_other_ingests(
    ix: Indexer, index: MemoryIndex, held: HeldReplay, pubs: list[EventPublisher]
) -> None:
    r0, r1 = StreamId("r0"), StreamId("r1")
    subscriber = ix.service.subscriber
    assert subscriber.worker_of(r0) != subscriber.worker_of(r1)  # 2 streams, 2 workers
    held.answer(held.request()[0], [])  # the connect's resync: nothing buffered yet
    warm_up(ix, pubs[1], r1)
    seq = pubs[0].publish([])
    wait_until(ix.applied(r0, seq), what="r0 live")
    pubs[0].publish(chain_batch(0, 0))
    lost = chain_batch(0, 1)
    lost_seq = pubs[0].publish(lost, drop=True)
    last0 = pubs[0].publish(chain_batch(0, 2))  # the gap: r0 asks for a replay, held
    identity, start = held.request()
    assert start == lost_seq
    wait_until(lambda: ix.status(r0).freshness is Freshness.REPLAYING, what="r0 replaying")
    for block in range(NUM_BATCHES):  # meanwhile r1's worker goes on
        seq = pubs[1].publish(chain_batch(1, block))
    wait_until(ix.applied(r1, seq), what="r1 applied while r0 replays")
    assert matched(index, 1, r1) == NUM_BATCHES
    assert ix.status(r0).freshness is Freshness.REPLAYING and matched(index, 0, r0) == 1
    payload = encode_batch(lost, ts=time.time(), rank=0, encoding="map")
    held.answer(identity, [(lost_seq, payload)])
    wait_until(ix.applied(r0, last0), what="r0 repaired")
    health = ix.status(r0).health
    assert matched(index, 0, r0) == 3 and health.num_gaps == 1
    assert (health.num_unrepaired_gaps, health.num_orphan_stores) == (0, 0)


class _WorkerKilled(BaseException):
    """What kills a worker's thread (the loop survives any ``Exception``)."""


def test_a_worker_that_dies_is_logged_restarted_and_its_stream_resynced(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = MemoryIndex()
    with publishers(2) as pubs:
        specs = [replica_of(pub, f"r{i}") for i, pub in enumerate(pubs)]
        with running_indexer(settings_for(*specs, ingest_workers=2), index) as ix:
            streams = [StreamId("r0"), StreamId("r1")]
            for pub, stream in zip(pubs, streams, strict=True):
                warm_up(ix, pub, stream)
            subscriber = ix.service.subscriber
            victim = subscriber.worker_of(streams[0])
            loop = subscriber.loops[victim]
            original = SubscriberLoop.run_once

            def dies_once(self: SubscriberLoop, timeout_ms: int = 50) -> None:
                if self is loop:
                    monkeypatch.setattr(SubscriberLoop, "run_once", original)
                    raise _WorkerKilled
                original(self, timeout_ms)

            with caplog.at_level(logging.ERROR, logger="kvindex.subscriber"):
                monkeypatch.setattr(SubscriberLoop, "run_once", dies_once)
                wait_until(lambda: subscriber.num_restarts == 1, what="restarted")
            died = [r for r in caplog.records if r.levelno == logging.CRITICAL]
            assert died and f"ingest worker {victim} died" in died[0].getMessage()
            assert any("stopped unexpectedly: restarted" in r.getMessage() for r in caplog.records)
            wait_until(lambda: subscriber.running, what="every worker running again")
            last = [0, 0]
            for block in range(NUM_BATCHES):
                for i, pub in enumerate(pubs):
                    last[i] = pub.publish(chain_batch(i, block), drop=(i == 0 and block == 3))
            for i, stream in enumerate(streams):
                wait_until(ix.applied(stream, last[i]), what=f"{stream} after the restart")
                assert matched(index, i, stream) == NUM_BATCHES  # the dropped one replayed
                assert ix.status(stream).health.num_orphan_stores == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_an_engine_restart_and_a_purge_are_handled_by_the_streams_worker(workers: int) -> None:
    """r0's engine restarts (seq from 0 again, same endpoints): r0 is cleared and holds only
    what the new engine stored; r1's replica goes away: its blocks are purged after
    ``purge_after_s``. Each on its own worker with 2."""
    index = MemoryIndex()
    first, gone = publisher_at(None, None), publisher_at(None, None)
    specs = [replica_of(first, "r0"), replica_of(gone, "r1")]
    settings = settings_for(*specs, ingest_workers=workers, purge_after_s=0.5)
    r0, r1 = StreamId("r0"), StreamId("r1")
    second: EventPublisher | None = None
    try:
        with running_indexer(settings, index) as ix:
            for pub, stream in ((first, r0), (gone, r1)):
                warm_up(ix, pub, stream)
            for block in range(3):
                last0 = first.publish(chain_batch(0, block))
                last1 = gone.publish(chain_batch(1, block))
            wait_until(ix.applied(r0, last0), what="r0 applied")
            wait_until(ix.applied(r1, last1), what="r1 applied")
            assert (matched(index, 0, r0), matched(index, 1, r1)) == (3, 3)
            assert first.replay_endpoint is not None
            endpoint, replay = first.endpoint, first.replay_endpoint
            first.close()
            gone.close()
            second = publisher_at(int(endpoint.rsplit(":", 1)[1]), int(replay.rsplit(":", 1)[1]))
            second.publish(chain_batch(0, 0))  # the new engine: seq 0, one block
            wait_until(lambda: ix.status(r0).health.num_restarts >= 1, what="r0 restart seen")
            wait_until(lambda: index.stats(r0).num_blocks == 1, what="r0 holds the new block")
            assert matched(index, 0, r0) == 1
            wait_until(lambda: index.stats(r1).num_blocks == 0, what="r1 purged")
    finally:
        for pub in (first, gone):
            pub.close()  # again if closed: a no-op
        if second is not None:
            second.close()
