"""Publisher (real ZeroMQ PUB + replay ROUTER, vLLM's format) → indexer → real redis-server."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest
import redis
import zmq

from kvindex.clients.fake_vllm.publisher import EventPublisher
from kvindex.indexer.domain.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    StreamId,
    Tier,
)
from kvindex.indexer.domain.keys import block_keys
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.protocol import BlockIndex
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.ingest.wire import Encoding, ReplayLayout, encode_batch, encode_live, to_wire
from kvindex.indexer.redis.connection import connect
from kvindex.indexer.redis.schema import Schema
from kvindex.indexer.service import IndexerService
from tests.integration.harness import (
    MODEL,
    consecutive_free_ports,
    publisher_at,
    replica_of,
    running_indexer,
    settings_for,
    wait_until,
    warm_up,
)
from tests.support.redis_server import RedisServer, free_port

R1 = StreamId("r1", 0)
TOKENS = list(range(1000, 1000 + 16 * 8))


def stored(
    hashes: tuple[int, ...],
    parent: int | None,
    first_block: int,
    *,
    extra_keys: tuple[tuple[object, ...] | None, ...] | None = None,
    lora_name: str | None = None,
) -> BlockStored:
    """A GPU store of consecutive blocks of TOKENS starting at ``first_block``."""
    tokens = TOKENS[first_block * 16 : (first_block + len(hashes)) * 16]
    return BlockStored(hashes, parent, tokens, 16, Tier.GPU, lora_name, extra_keys)


def matched(index: BlockIndex, stream: StreamId, num_blocks: int = 8, **kw: str) -> int:
    keys = block_keys(MODEL, TOKENS[: num_blocks * 16], 16, **kw)
    return index.longest_prefix(keys, [stream])[stream].num_blocks


@pytest.fixture
def index(redis_client: redis.Redis) -> Iterator[BlockIndex]:
    store = RedisIndex(redis_client, Schema("it"))
    yield store


@pytest.fixture
def pub() -> Iterator[EventPublisher]:
    publisher = publisher_at(None, None)
    yield publisher
    publisher.close()


def test_chains_across_batches_removals_and_clear(pub: EventPublisher, index: BlockIndex) -> None:
    with running_indexer(settings_for(replica_of(pub)), index) as ix:
        warm_up(ix, pub, R1)
        pub.publish([stored((11, 12), None, 0)])
        pub.publish([stored((13,), 12, 2)])
        seq = pub.publish([stored((14, 15), 13, 3)])
        wait_until(ix.applied(R1, seq), what="chain applied")
        assert matched(index, R1) == 5
        seq = pub.publish([BlockRemoved((14,), Tier.GPU)])
        wait_until(ix.applied(R1, seq))
        assert matched(index, R1) == 3
        seq = pub.publish([AllBlocksCleared()])
        wait_until(ix.applied(R1, seq))
        assert matched(index, R1) == 0
        assert index.stats(R1).num_blocks == 0


def test_dropped_batch_is_repaired_by_replay(pub: EventPublisher, index: BlockIndex) -> None:
    with running_indexer(settings_for(replica_of(pub)), index) as ix:
        warm_up(ix, pub, R1)
        pub.publish([stored((11, 12), None, 0)])
        pub.publish([stored((13,), 12, 2)], drop=True)
        seq = pub.publish([stored((14,), 13, 3)])
        wait_until(ix.applied(R1, seq), what="gap repaired")
        assert matched(index, R1) == 4
        counters = ix.status(R1).health
        assert counters.num_gaps == 1
        assert counters.num_unrepaired_gaps == 0
        assert counters.num_orphan_stores == 0


def test_gap_without_replay_endpoint_is_counted(index: BlockIndex) -> None:
    pub = publisher_at(None, None, replay=False)
    try:
        with running_indexer(settings_for(replica_of(pub)), index) as ix:
            warm_up(ix, pub, R1)
            pub.publish([stored((11, 12), None, 0)])
            pub.publish([stored((13,), 12, 2)], drop=True)
            seq = pub.publish([stored((14,), 13, 3)])
            wait_until(ix.applied(R1, seq))
            # Block 13 never arrived and the batch that dropped it may have removed 11 or
            # 12: the stream is cleared and holds only 14 (an orphan, not matched).
            assert matched(index, R1) == 0
            health = ix.status(R1).health
            assert (health.num_unrepaired_gaps, health.num_orphan_stores) == (1, 1)
            assert health.num_history_lost == 1
    finally:
        pub.close()


def test_seq_reset_is_an_engine_restart(index: BlockIndex) -> None:
    first = publisher_at(None, None)
    port, replay_port = _ports(first)
    spec = replica_of(first)
    with running_indexer(settings_for(spec), index) as ix:
        warm_up(ix, first, R1)
        first.publish([stored((11, 12), None, 0)])
        seq = first.publish([stored((13, 14), 12, 2)])
        wait_until(ix.applied(R1, seq))
        assert matched(index, R1) == 4
        first.close()
        second = publisher_at(port, replay_port)  # same endpoints, seq from 0 again
        try:
            second.publish([stored((21,), None, 0)])
            wait_until(lambda: ix.status(R1).health.num_restarts >= 1, what="restart seen")
            wait_until(ix.applied(R1, 0))
            assert matched(index, R1) == 1  # only what the new engine holds
            assert index.stats(R1).num_blocks == 1
        finally:
            second.close()


def _ports(pub: EventPublisher) -> tuple[int, int]:
    assert pub.replay_endpoint is not None
    return int(pub.endpoint.rsplit(":", 1)[1]), int(pub.replay_endpoint.rsplit(":", 1)[1])


def test_malformed_frames_are_counted_and_the_index_stays_intact(
    pub: EventPublisher, index: BlockIndex
) -> None:
    with running_indexer(settings_for(replica_of(pub)), index) as ix:
        warm_up(ix, pub, R1)
        seq = pub.publish([stored((11, 12), None, 0)])
        wait_until(ix.applied(R1, seq))
        pub.send_raw([b"kv@r1@demo-model", b"\x00\x01", b"\x90"])  # 2-byte seq frame
        pub.send_raw([b"only-one-frame"])
        good = to_wire(stored((13,), 12, 2), "map")
        bad = msgspec.structs.replace(good, block_hashes="not-a-list")
        payload = msgspec.msgpack.encode([1.0, [bad, good, {"type": "Nope"}], 0])
        seq = pub.publish_payload(payload)
        pub.publish_payload(b"\xc1garbage")  # undecodable payload with a valid seq
        seq = pub.publish([stored((14,), 13, 3)])
        wait_until(ix.applied(R1, seq))
        health = ix.status(R1).health
        assert health.num_decode_errors == 3
        assert health.num_bad_events == 2
        assert matched(index, R1) == 4


def test_two_data_parallel_ranks(index: BlockIndex) -> None:
    port = replay_port = consecutive_free_ports()
    while abs(replay_port - port) < 2:
        replay_port = consecutive_free_ports()
    rank0 = publisher_at(port, replay_port)
    rank1 = publisher_at(port + 1, replay_port + 1, rank=1)
    try:
        spec = replica_of(rank0, dp_size=2)
        with running_indexer(settings_for(spec), index) as ix:
            warm_up(ix, rank0, R1)
            warm_up(ix, rank1, StreamId("r1", 1))
            rank0.publish([stored((11, 12), None, 0)])
            seq0 = rank0.publish([stored((13,), 12, 2)])
            seq1 = rank1.publish([stored((11,), None, 0)])
            r1_rank1 = StreamId("r1", 1)
            wait_until(ix.applied(R1, seq0))
            wait_until(ix.applied(r1_rank1, seq1))
            assert matched(index, R1) == 3
            assert matched(index, r1_rank1) == 1
            assert index.stats(r1_rank1).watermark == seq1
    finally:
        rank1.close()
        rank0.close()


def test_lora_and_salt_keys_are_kept_apart(pub: EventPublisher, index: BlockIndex) -> None:
    with running_indexer(settings_for(replica_of(pub)), index) as ix:
        warm_up(ix, pub, R1)
        lora = [("sql-lora",), ("sql-lora",)]
        salt = [("tenant-a",), None]
        pub.publish([stored((31, 32), None, 0, extra_keys=tuple(lora), lora_name="sql-lora")])
        seq = pub.publish([stored((41, 42), None, 0, extra_keys=tuple(salt))])
        wait_until(ix.applied(R1, seq))
        assert matched(index, R1, 2) == 0  # plain request: neither
        assert matched(index, R1, 2, lora_name="sql-lora") == 2
        assert matched(index, R1, 2, cache_salt="tenant-a") == 2
        assert matched(index, R1, 2, lora_name="other") == 0
        assert matched(index, R1, 2, cache_salt="tenant-b") == 0


def test_cpu_tier_blocks(pub: EventPublisher, index: BlockIndex) -> None:
    with running_indexer(settings_for(replica_of(pub)), index) as ix:
        warm_up(ix, pub, R1)
        pub.publish([stored((11, 12), None, 0)])
        placeholder = BlockStored((11, 12), None, [], 0, Tier.CPU)
        pub.publish([placeholder])
        seq = pub.publish([BlockRemoved((11, 12), Tier.GPU)])
        wait_until(ix.applied(R1, seq))
        keys = block_keys(MODEL, TOKENS[:32], 16)
        assert index.longest_prefix(keys, [R1])[R1].tiers == (Tier.CPU, Tier.CPU)
        seq = pub.publish([BlockRemoved((11,), Tier.CPU)])
        wait_until(ix.applied(R1, seq))
        assert matched(index, R1) == 0


def test_bind_topology_registers_replicas_by_topic(index: BlockIndex) -> None:
    settings = settings_for(bind="tcp://127.0.0.1:*")
    with running_indexer(settings, index) as ix:
        endpoint = ix.service.subscriber.bound_endpoint
        assert endpoint is not None
        pub = EventPublisher(endpoint, topic=f"kv@r9@{MODEL}")
        try:
            stream = StreamId("r9", 0)

            def arrived() -> bool:
                pub.publish([stored((11, 12), None, 0)])
                return matched(index, stream) == 2

            wait_until(arrived, what="bound SUB receives")  # slow joiner: resend until seen
            spec = ix.service.registry.get("r9")
            assert spec is not None and spec.model == MODEL
        finally:
            pub.close()


@pytest.mark.parametrize(("encoding", "layout"), [("array", "legacy"), ("map", "topic")])
def test_both_encodings_and_replay_layouts(
    index: BlockIndex, encoding: Encoding, layout: ReplayLayout
) -> None:
    pub = publisher_at(None, None, encoding=encoding, replay_layout=layout)
    try:
        with running_indexer(settings_for(replica_of(pub)), index) as ix:
            warm_up(ix, pub, R1)
            pub.publish([stored((11, 12), None, 0)], drop=True)
            pub.publish([stored((13,), 12, 2)], drop=True)
            seq = pub.publish([stored((14,), 13, 3)])
            wait_until(ix.applied(R1, seq))
            assert matched(index, R1) == 4
            assert ix.status(R1).health.num_gaps == 1
    finally:
        pub.close()


def test_redis_going_away_is_counted_and_recovered(
    redis_server: RedisServer, redis_client: redis.Redis, pub: EventPublisher
) -> None:
    index = RedisIndex(connect(redis_server.url, socket_timeout_s=0.5), Schema("it"))
    with running_indexer(settings_for(replica_of(pub)), index) as ix:
        warm_up(ix, pub, R1)
        pub.publish([stored((11, 12), None, 0)])
        redis_server.stop()
        seq = pub.publish([stored((13,), 12, 2)])
        wait_until(lambda: ix.status(R1).health.num_store_errors >= 1, what="store error counted")
        redis_server.restart()  # comes back empty: the replay buffer rebuilds the stream
        wait_until(ix.applied(R1, seq), timeout_s=15, what="stream resynced")
        wait_until(lambda: matched(index, R1) == 3, what="index rebuilt")
    index.close()


def test_history_lost_beyond_a_small_replay_buffer_is_not_credited(index: BlockIndex) -> None:
    pub = publisher_at(None, None, buffer_steps=4)
    try:
        with running_indexer(settings_for(replica_of(pub)), index) as ix:
            warm_up(ix, pub, R1)
            seq = pub.publish([stored((11, 12), None, 0)])
            wait_until(ix.applied(R1, seq))
            pub.publish([BlockRemoved((12,), Tier.GPU)], drop=True)  # lost for good...
            for _ in range(6):  # ...once the 4-batch buffer has moved past it
                pub.publish([], drop=True)
            seq = pub.publish([stored((21,), None, 4)])
            wait_until(ix.applied(R1, seq), what="truncated replay applied")
            health = ix.status(R1).health
            assert (health.num_replay_truncated, health.num_history_lost) == (1, 1)
            assert matched(index, R1) == 0  # 11 may still be cached, 12 is not: neither credited
            assert index.stats(R1).num_blocks == 1  # what the replica sent since: block 21
            status = ix.status(R1)  # 11 may still be held: the view is partial, not live
            assert (status.freshness.value, status.health.partial) == (
                "partial",
                "replay_gap_past_buffer",
            )
    finally:
        pub.close()


def test_a_replica_restarted_quiet_loses_its_old_blocks_on_reconnect(index: BlockIndex) -> None:
    first = publisher_at(None, None)
    port, replay_port = _ports(first)
    with running_indexer(settings_for(replica_of(first)), index) as ix:
        warm_up(ix, first, R1)
        seq = first.publish([stored((11, 12), None, 0)])
        wait_until(ix.applied(R1, seq))
        first.close()
        started = time.monotonic()
        second = publisher_at(port, replay_port)  # same endpoints, publishes nothing
        try:
            wait_until(lambda: matched(index, R1) == 0, timeout_s=10, what="old blocks dropped")
            took = time.monotonic() - started
            print(f"quiet restart seen on reconnect in {took:.2f} s")
            assert ix.status(R1).health.num_restarts == 1
        finally:
            second.close()


def test_a_replica_restarted_quiet_in_bind_mode_is_found_by_the_probe(index: BlockIndex) -> None:
    replay_port = free_port()
    replay = f"tcp://127.0.0.1:{replay_port}"
    spec = ReplicaSpec(id="r1", model=MODEL, replay=replay)
    settings = settings_for(spec, bind="tcp://127.0.0.1:*", probe_interval_s=1.0)
    with running_indexer(settings, index) as ix:
        endpoint = ix.service.subscriber.bound_endpoint
        assert endpoint is not None
        first = _connecting_publisher(endpoint, replay)

        def arrived() -> bool:
            first.publish([stored((11, 12), None, 0)])
            return matched(index, R1) == 2

        wait_until(arrived, what="bound SUB receives")  # slow joiner: resend until seen
        first.close()
        started = time.monotonic()
        second = _connecting_publisher(endpoint, replay)  # quiet: publishes nothing
        try:
            wait_until(lambda: matched(index, R1) == 0, timeout_s=10, what="old blocks dropped")
            took = time.monotonic() - started
            bound = settings.probe_interval_s + 1.0 + 2 * 0.5  # tick + two local replays
            print(f"quiet restart found by the probe in {took:.2f} s (bound {bound:.1f} s)")
            assert took < bound
            # The restart is counted as the stream is cleared: read it once both are done.
            wait_until(
                lambda: ix.status(R1).health.num_restarts >= 1, timeout_s=2, what="restart counted"
            )
            health = ix.status(R1).health
            assert health.num_probes >= 1 and health.num_restarts == 1
        finally:
            second.close()


def _connecting_publisher(endpoint: str, replay: str) -> EventPublisher:
    """A publisher that connects to the indexer's bound SUB and binds its replay ROUTER,
    retrying while the port is still held by the previous one."""
    deadline = time.monotonic() + 5
    while True:
        try:
            return EventPublisher(endpoint, replay, topic=f"kv@r1@{MODEL}")
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_dead_store_costs_one_wait_not_one_per_stream() -> None:
    """Redis refused (nothing listens): each stream's first write fails; without the write
    path's circuit every one waits out its own failed call (0.7 s here), one after another,
    in the loop that also drains the sockets."""
    num_streams = 12
    dead = f"redis://127.0.0.1:{free_port()}/0"
    replicas = tuple(ReplicaSpec(f"r{i}", "m") for i in range(num_streams))
    settings = settings_for(*replicas, store="redis", redis_url=dead, store_cooldown_s=30.0)
    service = IndexerService.build(settings)
    pipeline = service.subscriber.pipeline
    try:
        started = time.monotonic()
        for spec in replicas:
            stream = StreamId(spec.id)
            pipeline.track(stream, spec)
            block = BlockStored((1,), None, list(range(16)), 16, Tier.GPU)
            payload = encode_batch([block], ts=1.0, rank=0, encoding="map")
            pipeline.handle_frames([encode_live(f"kv@{spec.id}@m".encode(), 0, payload)], stream)
        pipeline.maintain()  # every stream broken: a resync try each
        took = time.monotonic() - started
    finally:
        service.index.close()
    records = service.registry.records()
    errors = [records[StreamId(s.id)].num_store_errors for s in replicas]
    assert errors == [1] * num_streams  # every stream counted, none lost silently
    assert took < 3.0, f"{took:.1f} s for {num_streams} streams"
