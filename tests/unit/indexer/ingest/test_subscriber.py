"""Subscriber: the socket loop's own behaviour (these tests open no connection: their
replicas' ports have no listener)."""

from __future__ import annotations

import logging
import time

import fakeredis
import pytest
import zmq

from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.domain.errors import SettingsError
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.ingest.membership import Membership, Shard
from kvindex.indexer.ingest.poller import ReadablePoller
from kvindex.indexer.ingest.subscriber import (
    SocketLimitError,
    Subscriber,
    _ReplaySockets,
)
from kvindex.indexer.redis.schema import Schema
from tests.support.clock import Clock
from tests.support.redis_server import free_port


@pytest.mark.latency_bound
@pytest.mark.parametrize("workers", [1, 2])
def test_a_loop_with_no_socket_to_poll_waits_instead_of_spinning(workers: int) -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    settings = IndexerSettings(ingest_workers=workers)
    subscriber = Subscriber(settings, MemoryIndex(), Registry(()), context=context)
    subscriber.start()  # no replica, no bind: nothing to poll
    try:
        cpu_before = time.process_time()
        time.sleep(1.0)
        # The process's CPU over 1 s is the loop thread's (this one sleeps): a spinning
        # loop burns about 1 s of it, a waiting one next to nothing.
        assert time.process_time() - cpu_before < 0.3
    finally:
        subscriber.stop()
        context.term()


# --- socket limits -----------------------------------------------------------------------

Context = zmq.Context[zmq.Socket[bytes]]


def _tiny_context(max_sockets: int) -> Context:
    context: Context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, max_sockets)
    return context


def _replicas(num_replicas: int, *, replay: bool = False) -> tuple[ReplicaSpec, ...]:
    """Replicas on loopback ports nobody listens on (a SUB connects in the background)."""
    port = free_port()
    return tuple(
        ReplicaSpec(
            f"r{i}",
            "m",
            events=f"tcp://127.0.0.1:{port}",
            replay=f"tcp://127.0.0.1:{port}" if replay else None,
        )
        for i in range(num_replicas)
    )


def _open_sockets_until_full(context: Context, timeout_s: float = 3.0) -> int:
    """How many sockets ``context`` can still open (closed again); a closed socket's slot is
    freed by libzmq's reaper thread, so this retries until the count stops growing."""
    best, deadline = 0, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sockets = []
        try:
            while True:
                sockets.append(context.socket(zmq.PAIR))
        except zmq.ZMQError:
            pass
        for sock in sockets:
            sock.close(linger=0)
        best = max(best, len(sockets))
        time.sleep(0.05)
    return best


def test_out_of_sockets_at_start_is_a_named_error_with_nothing_left_open() -> None:
    context = _tiny_context(8)  # a stream holds 3 sockets: the third replica does not fit
    registry = Registry(_replicas(5))
    settings = IndexerSettings(ingest_workers=1)  # the counts below are one loop's
    subscriber = Subscriber(settings, MemoryIndex(), registry, context=context)
    try:
        with pytest.raises(SocketLimitError) as caught:
            subscriber.start()
        message = str(caught.value)
        assert "cannot open the sockets of replica 'r2' (2 streams open)" in message
        assert "ZeroMQ sockets per context 8" in message and "open-file limit" in message
        assert "ulimit -Hn" in message and "max_open_files" in message
        assert subscriber.subscribed_replicas == [] and not subscriber.running
        assert _open_sockets_until_full(context) == 8  # every socket it opened is closed
    finally:
        subscriber.stop()
        context.term()


def test_a_replica_that_does_not_fit_later_is_one_error_line_and_opens_once_room_is_made(
    caplog: pytest.LogCaptureFixture,
) -> None:
    context = _tiny_context(6)
    registry = Registry(_replicas(3))
    settings = IndexerSettings(ingest_workers=1)  # the counts below are one loop's
    subscriber = Subscriber(settings, MemoryIndex(), registry, context=context)
    try:
        with caplog.at_level(logging.ERROR, logger="kvindex.subscriber"):
            for _ in range(3):
                subscriber.run_once(timeout_ms=1)  # the loop's turns: no exception escapes
        assert subscriber.subscribed_replicas == ["r0", "r1"]
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and errors[0].exc_info is None  # one line, no traceback
        assert errors[0].getMessage().startswith("1 replicas not subscribed: cannot open")
        assert "ulimit -Hn" in errors[0].getMessage()
        registry.remove("r0")
        deadline = time.monotonic() + 5
        while subscriber.subscribed_replicas != ["r1", "r2"] and time.monotonic() < deadline:
            subscriber.run_once(timeout_ms=50)  # retried each maintenance turn
        assert subscriber.subscribed_replicas == ["r1", "r2"]
    finally:
        subscriber.stop()
        context.term()


def test_a_replay_socket_that_cannot_open_fails_as_a_timed_out_replay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    context = _tiny_context(1)
    holder = context.socket(zmq.PAIR)  # the one socket the context allows
    replays = _ReplaySockets(lambda: context, ReadablePoller(), 5.0, time.monotonic)
    first, second = StreamId("r1", 0), StreamId("r2", 0)
    try:
        with caplog.at_level(logging.ERROR, logger="kvindex.subscriber"):
            replays.start_replay(first, "tcp://127.0.0.1:9", 0)
            replays.start_replay(second, "tcp://127.0.0.1:9", 0)
        assert replays.expired() == [first, second]  # the pipeline gives both up at once
        assert replays.end_replay(first) == 0 and replays.expired() == [second]
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "cannot open a replay socket" in errors[0].getMessage()
    finally:
        replays.end_replay(second)
        holder.close(linger=0)
        context.term()


# --- the poller ----------------------------------------------------------------------------


def test_a_sharded_subscriber_opens_the_streams_it_owns_and_takes_over_a_leaver() -> None:
    clock, client = Clock(), fakeredis.FakeRedis()
    schema = Schema("test")
    mine = Membership(client, schema, "a", lease_ttl_s=3.0, clock=clock)
    other = Membership(client, schema, "b", lease_ttl_s=3.0, clock=clock)
    other.renew()
    index = RedisIndex(client, schema, owner=mine.token)
    specs = _replicas(12)
    settings = IndexerSettings(replicas=specs)
    subscriber = Subscriber(settings, index, Registry(specs), shard=Shard(mine, index))
    mine.tick()  # as the service does before the subscriber starts
    subscriber.start()
    try:
        owned = [s.id for s in specs if mine.owns(StreamId(s.id))]
        assert 0 < len(owned) < len(specs)
        assert subscriber.subscribed_replicas == sorted(owned)
        assert all(index.owner(StreamId(r)) == mine.token for r in owned)
        other.leave()
        clock.now += mine.renew_period_s
        deadline = time.monotonic() + 5.0
        while len(subscriber.subscribed_replicas) < len(specs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert subscriber.subscribed_replicas == sorted(s.id for s in specs)
    finally:
        subscriber.stop()


def test_a_claim_another_indexer_took_is_handed_over_then_claimed_back() -> None:
    """A stream claimed since by another token (an owner whose view lagged this one's join)
    is let go at the next renew, quiet as it is, and claimed back after one renew period."""
    clock, client = Clock(), fakeredis.FakeRedis()
    schema = Schema("test")
    mine = Membership(client, schema, "a", lease_ttl_s=3.0, clock=clock)
    index = RedisIndex(client, schema, owner=mine.token)
    specs = _replicas(3)
    subscriber = Subscriber(
        IndexerSettings(replicas=specs),
        index,
        Registry(specs),
        clock=clock,
        shard=Shard(mine, index),
    )
    mine.tick()
    try:
        subscriber.run_once(timeout_ms=1)
        assert subscriber.subscribed_replicas == ["r0", "r1", "r2"]
        client.hset(schema.stream_owners, str(StreamId("r0")), "b#late")
        clock.now += mine.renew_period_s
        subscriber.run_once(timeout_ms=1)
        assert subscriber.subscribed_replicas == ["r1", "r2"]
        clock.now += mine.renew_period_s
        subscriber.run_once(timeout_ms=1)
        assert subscriber.subscribed_replicas == ["r0", "r1", "r2"]
        assert client.hget(schema.stream_owners, str(StreamId("r0"))) == mine.token.encode()
    finally:
        subscriber.stop()


# --- ingest workers ------------------------------------------------------------------------


def test_workers_share_the_replicas_the_first_reads_the_bound_sub_and_stop_stops_all() -> None:
    context: Context = zmq.Context()
    specs = _replicas(5)
    settings = IndexerSettings(replicas=specs, bind="tcp://127.0.0.1:0", ingest_workers=2)
    subscriber = Subscriber(settings, MemoryIndex(), Registry(specs), context=context)
    subscriber.start()
    try:
        assert [len(loop.subscribed_replicas) for loop in subscriber.loops] == [3, 2]
        assert subscriber.subscribed_replicas == [s.id for s in specs]
        assert subscriber.bound_endpoint is not None
        assert subscriber.loops[1].bound_endpoint is None
        assert subscriber.running
        threads = [t for t in subscriber._threads if t is not None]
        assert len(threads) == 2 and all(t.is_alive() for t in threads)
    finally:
        subscriber.stop()
        context.term()
    assert not subscriber.running and not any(t.is_alive() for t in threads)
    assert subscriber.subscribed_replicas == []


def test_a_replica_added_later_goes_to_the_worker_with_fewer_streams() -> None:
    context: Context = zmq.Context()
    specs = _replicas(4)
    registry = Registry(specs[:3])
    settings = IndexerSettings(ingest_workers=2)
    subscriber = Subscriber(settings, MemoryIndex(), registry, context=context)
    try:
        subscriber.run_once(timeout_ms=1)
        assert [loop.subscribed_replicas for loop in subscriber.loops] == [["r0", "r2"], ["r1"]]
        registry.add(specs[3])
        subscriber.run_once(timeout_ms=1)
        assert subscriber.loops[1].subscribed_replicas == ["r1", "r3"]
        assert subscriber.worker_of(StreamId("r3")) == 1
    finally:
        subscriber.stop()
        context.term()


def test_a_sharded_indexer_runs_one_worker_and_redis_refuses_more() -> None:
    client = fakeredis.FakeRedis()
    membership = Membership(client, Schema("test"), "a", lease_ttl_s=3.0)
    index = RedisIndex(client, Schema("test"), owner=membership.token)
    settings = IndexerSettings(store="redis")
    assert settings.num_ingest_workers == 1
    shard = Shard(membership, index)
    subscriber = Subscriber(settings, index, Registry(()), shard=shard, num_workers=4)
    assert len(subscriber.loops) == 1
    with pytest.raises(SettingsError, match="ingest_workers = 2 is for the memory store"):
        IndexerSettings(store="redis", ingest_workers=2)
