"""Pipeline: the write path without sockets — frames in, index and stream records out, replay
requests to a fake socket owner."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from kvindex.api.http.views import stats_view
from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.domain.events import (
    AllBlocksCleared,
    BlockStored,
    Event,
    EventBatch,
    StreamId,
    Tier,
)
from kvindex.indexer.domain.health import StreamHealth, UnroutedCounters
from kvindex.indexer.domain.keys import block_keys
from kvindex.indexer.fleet.registry import Freshness, Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import (
    ApplyResult,
    BatchOps,
    IndexUnavailableError,
    StreamStats,
)
from kvindex.indexer.ingest.pipeline import (
    MAX_TOPIC_ID_CHARS,
    MAX_TOPIC_MODEL_CHARS,
    MAX_TOPIC_RANKS,
    Pipeline,
)
from kvindex.indexer.ingest.wire import ReplayReply, encode_batch, encode_live
from tests.support.clock import Clock

MODEL = "m"
BLOCK = 4
R1 = StreamId("r1")
REPLAY = "tcp://127.0.0.1:5558"
TOPIC = f"kv@r1@{MODEL}".encode()


@dataclass
class Replays:
    """The socket owner's side: records what the pipeline asks for."""

    started: list[tuple[StreamId, str, int]] = field(default_factory=list)
    open: set[StreamId] = field(default_factory=set)
    num_bad_frames: int = 0

    def start_replay(self, stream: StreamId, endpoint: str, start_seq: int) -> None:
        assert stream not in self.open, "a replay was started over an open one"
        self.open.add(stream)
        self.started.append((stream, endpoint, start_seq))

    def end_replay(self, stream: StreamId) -> int:
        assert stream in self.open, "ended a replay that was not open"
        self.open.discard(stream)
        return self.num_bad_frames


class FlakyIndex(MemoryIndex):
    """A memory index whose store can go down."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.num_losses = 0
        self._unseen_loss = False
        self.num_intact_calls = 0

    def _check(self) -> None:
        if self.down:
            raise IndexUnavailableError("store down")

    def lose_everything(self) -> None:
        """What a Redis restarted empty (or flushed) does to the data."""
        for stream in self.streams():
            super().drop(stream)
        self.num_losses += 1
        self._unseen_loss = True

    def intact(self) -> bool:
        self._check()
        self.num_intact_calls += 1
        lost, self._unseen_loss = self._unseen_loss, False
        return not lost

    def apply_many(self, stream: StreamId, batches: Sequence[BatchOps]) -> list[ApplyResult]:
        self._check()
        return super().apply_many(stream, batches)

    def stats(self, stream: StreamId) -> StreamStats:
        self._check()
        return super().stats(stream)

    def clear(self, stream: StreamId) -> None:
        self._check()
        super().clear(stream)


@dataclass
class Rig:
    pipeline: Pipeline
    index: FlakyIndex
    registry: Registry
    replays: Replays
    clock: Clock

    def health(self, stream: StreamId = R1) -> StreamHealth:
        status = self.registry.status(stream)
        assert status is not None, f"no record for {stream}"
        return status.health

    def freshness(self, stream: StreamId = R1) -> Freshness:
        status = self.registry.status(stream)
        assert status is not None
        return status.freshness

    def blocks(self, *seqs: int) -> int:
        """How many blocks of the chain stored by ``batch(seq)`` for ``seqs`` r1 holds."""
        keys = block_keys(MODEL, [t for s in seqs for t in tokens(s)], BLOCK)
        return self.index.longest_prefix(keys, [R1])[R1].num_blocks


def rig(*, replay: bool = True, **settings: object) -> Rig:
    clock = Clock()
    spec = ReplicaSpec("r1", MODEL, replay=REPLAY if replay else None)
    config = IndexerSettings(replicas=(spec,), **settings)  # type: ignore[arg-type]
    registry = Registry(config.replicas, clock=clock)
    index, replays = FlakyIndex(), Replays()
    pipeline = Pipeline(config, index, registry, replays=replays, clock=clock)
    pipeline.track(R1, spec)
    return Rig(pipeline, index, registry, replays, clock)


def tokens(seq: int) -> list[int]:
    return [seq * 100 + i for i in range(BLOCK)]


def store(seq: int) -> BlockStored:
    """One block chained from the block ``store(seq - 1)`` put in (a root for seq 0)."""
    parent = None if seq == 0 else seq - 1
    return BlockStored((seq,), parent, tokens(seq), BLOCK, Tier.GPU)


def batch(seq: int, ts: float | None = None) -> EventBatch:
    return EventBatch(seq, 10.0 + seq if ts is None else ts, 0, (store(seq),))


def frames(seq: int, ts: float | None = None, events: list[Event] | None = None) -> list[bytes]:
    live = batch(seq, ts)
    shown = list(live.events) if events is None else events
    payload = encode_batch(shown, ts=live.ts, rank=0, encoding="map")
    return encode_live(TOPIC, seq, payload)


def replies(*batches: EventBatch, end: bool = True) -> list[ReplayReply]:
    found = [ReplayReply(b.seq, b) for b in batches]
    return [*found, ReplayReply(-1, None)] if end else found


def synced(r: Rig, last: int) -> None:
    """Connect and resync r1 with seqs 0..last, as at start."""
    r.pipeline.on_connected(R1)
    r.pipeline.on_replay(R1, replies(*(batch(s) for s in range(last + 1))))


# --- in order -----------------------------------------------------------------------------


def test_in_order_frames_are_applied_and_recorded_once_per_call() -> None:
    r = rig(replay=False)
    r.pipeline.handle_frames([frames(0), frames(1), frames(2)], R1)
    assert r.blocks(0, 1, 2) == 3
    health = r.health()
    assert (health.num_batches, health.last_seq, health.block_size) == (3, 2, BLOCK)
    assert health.last_event_ts == 12.0
    assert r.replays.started == []


def test_a_connect_resyncs_by_replay_and_the_record_shows_it_replaying() -> None:
    r = rig()
    r.pipeline.on_connected(R1)
    assert r.replays.started == [(R1, REPLAY, 0)]
    assert r.health().connected
    assert r.freshness() is Freshness.REPLAYING
    r.pipeline.on_replay(R1, replies(batch(0), batch(1)))
    assert r.replays.open == set()
    assert r.freshness() is Freshness.LIVE
    assert (r.health().last_seq, r.blocks(0, 1)) == (1, 2)


# --- gaps and restarts ----------------------------------------------------------------------


def test_a_gap_asks_for_a_replay_from_the_first_missing_seq() -> None:
    r = rig()
    synced(r, last=1)
    r.pipeline.handle_frames([frames(4), frames(5)], R1)
    assert r.replays.started[-1] == (R1, REPLAY, 2)
    assert r.health().num_gaps == 1
    r.pipeline.on_replay(R1, replies(batch(2), batch(3), batch(4)))
    assert r.blocks(0, 1, 2, 3, 4, 5) == 6
    assert (r.health().last_seq, r.health().num_duplicates) == (5, 1)
    assert r.freshness() is Freshness.LIVE


def test_without_replay_a_gap_is_applied_through_and_counted_unrepaired() -> None:
    r = rig(replay=False)
    r.pipeline.handle_frames([frames(0), frames(3)], R1)
    health = r.health()
    assert (health.num_gaps, health.num_unrepaired_gaps, health.last_seq) == (1, 1, 3)


def test_a_replay_that_times_out_applies_what_waited() -> None:
    r = rig()
    synced(r, last=1)
    r.pipeline.handle_live(frames(4, events=[]), R1)
    r.pipeline.replay_timed_out(R1)
    assert r.replays.open == set()
    health = r.health()
    assert (health.num_replay_failures, health.num_unrepaired_gaps, health.last_seq) == (1, 1, 4)


def test_an_engine_restart_clears_the_stream_and_resyncs_from_zero() -> None:
    r = rig()
    synced(r, last=2)
    r.pipeline.handle_live(frames(0, ts=99.0), R1)  # seq went back, a new engine's batch?
    assert r.replays.started[-1] == (R1, REPLAY, 0)  # the engine's replay will tell
    r.pipeline.on_replay(R1, replies(batch(0, ts=99.0)))
    assert r.health().num_restarts == 1
    assert (r.blocks(0), r.blocks(0, 1), r.health().last_seq) == (1, 1, 0)


def test_without_replay_a_restart_clears_and_applies_the_new_batch() -> None:
    r = rig(replay=False)
    r.pipeline.handle_frames([frames(0), frames(1)], R1)
    r.pipeline.handle_frames([frames(0, ts=99.0), frames(1, ts=99.5)], R1)
    assert (r.health().num_restarts, r.health().last_seq) == (1, 1)
    assert r.blocks(0, 1) == 2


@pytest.mark.parametrize("replay", [True, False])
def test_a_repeated_live_seq_is_a_duplicate_not_a_restart(replay: bool) -> None:
    r = rig(replay=replay)
    if replay:
        synced(r, last=-1)
    r.pipeline.handle_frames([frames(0), frames(1), frames(2)], R1)
    r.pipeline.handle_live(frames(2, ts=77.0), R1)  # seq 2 again, another payload
    r.pipeline.on_replay(R1, replies(batch(0), batch(1), batch(2)))  # ignored without replay
    r.pipeline.handle_live(frames(3), R1)
    assert r.blocks(0, 1, 2, 3) == 4
    health = r.health()
    assert (health.num_restarts, health.last_seq) == (0, 3)
    assert health.num_duplicates >= 1


def test_orphaned_stores_rebuild_by_replay_once_per_cooldown() -> None:
    r = rig(rebuild_cooldown_s=60.0)
    synced(r, last=0)
    orphan = BlockStored((7,), 6, tokens(7), BLOCK, Tier.GPU)
    r.pipeline.handle_live(frames(1, events=[orphan]), R1)
    assert r.health().num_orphan_stores == 1
    assert (r.replays.started[-1], r.health().num_rebuilds) == ((R1, REPLAY, 0), 1)
    r.pipeline.on_replay(R1, replies(batch(0), batch(1)))
    r.pipeline.handle_live(frames(2, events=[orphan]), R1)
    assert r.health().num_rebuilds == 1  # within the cooldown


# --- bad frames -----------------------------------------------------------------------------


def test_bad_frames_are_counted_and_a_readable_seq_is_moved_past() -> None:
    r = rig(replay=False)
    r.pipeline.handle_frames(
        [frames(0), [TOPIC, b"x"], [TOPIC, (1).to_bytes(8, "big"), b"\xc1"]], R1
    )
    r.pipeline.handle_live(frames(2), R1)
    health = r.health()
    assert health.num_decode_errors == 2
    assert (health.num_gaps, health.last_seq) == (0, 2)  # seq 1 was skipped, not missed


def test_undecodable_replay_replies_are_counted_when_the_replay_ends() -> None:
    r = rig()
    r.pipeline.on_connected(R1)
    r.replays.num_bad_frames = 3
    r.pipeline.on_replay(R1, replies(batch(0)))
    assert r.health().num_decode_errors == 3


def test_frames_of_no_known_stream_are_counted_apart() -> None:
    r = rig()
    r.pipeline.handle_live([b"x"], None)
    r.pipeline.handle_live(frames(0), StreamId("nobody"))
    assert (r.pipeline.counters.num_undecodable, r.pipeline.counters.num_unidentified) == (1, 1)
    assert r.registry.status(StreamId("nobody")) is None


# --- registration and removal ---------------------------------------------------------------


def topic_frames(topic: bytes, rank: int = 0) -> list[bytes]:
    payload = encode_batch([], ts=10.0, rank=rank, encoding="map")
    return encode_live(topic, 0, payload)


def test_undecodable_frames_on_the_bound_sub_reach_the_registry() -> None:
    r = rig()
    r.pipeline.handle_frames([[b"x"], [TOPIC, b"\x00" * 8, b"\xc1"]], None)
    assert r.registry.unrouted().num_undecodable == 2
    assert stats_view(r.registry, r.index).decode_errors == 2


def test_the_bound_sub_registers_topics_only_within_limits() -> None:
    r = rig(max_self_registered=2)
    refused = [
        topic_frames(b"kv@" + b"i" * (MAX_TOPIC_ID_CHARS + 1) + b"@m"),
        topic_frames(b"kv@long-model@" + b"m" * (MAX_TOPIC_MODEL_CHARS + 1)),
        topic_frames(b"kv@bad-rank@m", rank=-1),
        topic_frames(b"kv@high-rank@m", rank=MAX_TOPIC_RANKS),
    ]
    r.pipeline.handle_frames(refused, None)
    accepted = [topic_frames(b"kv@a@m"), topic_frames(b"kv@b@m", rank=MAX_TOPIC_RANKS - 1)]
    r.pipeline.handle_frames([*accepted, topic_frames(b"kv@c@m")], None)
    assert [spec.id for spec in r.registry.replicas()] == ["a", "b", "r1"]
    assert r.registry.unrouted().num_refused == 5
    r.pipeline.handle_frames([topic_frames(b"kv@a@m", rank=1)], None)  # known: another rank
    assert r.registry.status(StreamId("a", 1)) is not None


def test_bind_mode_registers_a_replica_from_its_topic() -> None:
    r = rig()
    assert r.pipeline.reconcile() == [r.registry.get("r1")]
    topic = b"kv@r7@other-model"
    payload = encode_batch(list(batch(0).events), ts=10.0, rank=1, encoding="map")
    r.pipeline.handle_live(encode_live(topic, 0, payload), None)
    assert r.registry.get("r7") == ReplicaSpec("r7", "other-model")
    assert r.health(StreamId("r7", 1)).last_seq == 0
    assert r.pipeline.reconcile() is None  # no socket to open for it


def test_a_topic_without_model_needs_a_default_model() -> None:
    r = rig()
    payload = encode_batch([], ts=10.0, rank=0, encoding="map")
    r.pipeline.handle_live(encode_live(b"kv@r8@", 0, payload), None)
    assert r.registry.get("r8") is None
    assert r.pipeline.counters.num_unidentified == 1
    other = rig(default_model="fallback")
    other.pipeline.handle_live(encode_live(b"kv@r8@", 0, payload), None)
    assert other.registry.get("r8") == ReplicaSpec("r8", "fallback")


def test_a_removed_replica_is_forgotten_and_its_blocks_purged() -> None:
    r = rig()
    synced(r, last=1)
    r.pipeline.handle_live(frames(2), R1)
    r.pipeline.on_disconnected(R1)
    r.pipeline.on_connected(R1)  # a resync replay is open
    assert r.pipeline.reconcile() is not None
    r.registry.remove("r1")
    assert r.pipeline.reconcile() == []
    assert r.replays.open == set()
    assert r.index.streams() == []
    r.pipeline.handle_live(frames(3), R1)
    assert r.registry.status(R1) is None


def test_a_stream_disconnected_too_long_is_purged_once() -> None:
    r = rig(replay=False, purge_after_s=30.0)
    r.pipeline.on_connected(R1)
    r.pipeline.handle_frames([frames(0), frames(1)], R1)
    r.pipeline.on_disconnected(R1)
    r.clock.now += 10.0
    r.pipeline.maintain()
    assert r.blocks(0, 1) == 2
    r.clock.now += 30.0
    r.pipeline.maintain()
    assert r.blocks(0, 1) == 0
    assert r.freshness() is Freshness.STALE


# --- the index store fails and comes back ---------------------------------------------------


def test_a_store_failure_is_counted_and_the_stream_resynced_when_it_is_back() -> None:
    r = rig()
    synced(r, last=0)
    r.index.down = True
    r.pipeline.handle_live(frames(1), R1)
    assert r.health().num_store_errors == 1
    r.pipeline.handle_live(frames(2), R1)  # dropped: the stream waits for the store
    r.pipeline.maintain()  # still down: nothing to do
    assert r.health().num_store_errors == 1
    r.index.down = False
    r.pipeline.maintain()
    assert r.replays.started[-1] == (R1, REPLAY, 0)
    r.pipeline.on_replay(R1, replies(batch(0), batch(1), batch(2)))
    assert (r.blocks(0, 1, 2), r.health().last_seq) == (3, 2)
    assert r.freshness() is Freshness.LIVE


# --- the index store lost its data ------------------------------------------------------


def test_a_store_that_lost_its_data_is_refilled_at_once_by_replay_from_zero() -> None:
    r = rig()
    synced(r, last=2)
    r.index.lose_everything()
    r.pipeline.handle_live(frames(3), R1)  # applied onto the emptied store before a look
    num_replays = len(r.replays.started)
    r.pipeline.maintain()
    assert r.replays.started[num_replays:] == [(R1, REPLAY, 0)]
    assert r.index.stats(R1).watermark == -1  # cleared: seq 3 would hide 0..2
    r.pipeline.on_replay(R1, replies(*(batch(s) for s in range(4))))
    assert (r.blocks(0, 1, 2, 3), r.health().last_seq) == (4, 3)
    assert (r.health().num_store_refills, r.health().num_restarts) == (1, 0)
    assert r.freshness() is Freshness.LIVE


def test_a_store_that_kept_its_data_costs_nothing() -> None:
    r = rig()
    synced(r, last=2)
    num_replays = len(r.replays.started)
    for _ in range(3):
        r.pipeline.maintain()
    assert r.index.num_intact_calls >= 3
    assert len(r.replays.started) == num_replays
    assert (r.health().num_store_refills, r.blocks(0, 1, 2)) == (0, 3)


def test_without_replay_a_refilled_stream_starts_over_from_its_next_batch() -> None:
    r = rig(replay=False)
    r.pipeline.handle_frames([frames(0), frames(1)], R1)
    r.index.lose_everything()
    r.pipeline.maintain()
    r.pipeline.handle_live(frames(2), R1)
    health = r.health()
    assert (health.num_store_refills, health.num_gaps, health.num_history_lost) == (1, 0, 0)
    assert (health.last_seq, r.index.stats(R1).watermark) == (2, 2)


def test_a_store_back_empty_after_failed_writes_ends_equal_to_the_replicas_cache() -> None:
    r = rig()
    synced(r, last=1)
    r.index.down = True
    r.pipeline.handle_live(frames(2), R1)  # fails: the stream waits for the store
    r.index.lose_everything()
    r.index.down = False
    num_replays = len(r.replays.started)
    r.pipeline.maintain()
    assert r.replays.started[num_replays:] == [(R1, REPLAY, 0)]  # one rebuild, not two
    r.pipeline.on_replay(R1, replies(batch(0), batch(1), batch(2)))
    assert (r.blocks(0, 1, 2), r.index.stats(R1).num_blocks) == (3, 3)
    assert r.health().num_store_refills == 1


# --- history that cannot be repaired ------------------------------------------------------


def test_a_truncated_replay_drops_the_lost_history_and_cannot_loop_on_orphans() -> None:
    r = rig(rebuild_cooldown_s=60.0)
    synced(r, last=2)
    r.pipeline.handle_live(frames(6), R1)
    r.pipeline.on_replay(R1, replies(batch(5), batch(6)))  # 3 and 4 aged out of the buffer
    assert r.blocks(0, 1, 2) == 0  # no longer credited: removals of them may be lost too
    health = r.health()
    assert (health.num_replay_truncated, health.num_history_lost) == (1, 1)
    assert (health.last_seq, r.freshness()) == (6, Freshness.PARTIAL)
    assert (health.partial, health.partial_since) == ("replay_gap_past_buffer", r.clock.now)
    num_replays = len(r.replays.started)
    r.pipeline.handle_live(frames(7), R1)  # orphans (parents lost with the history)
    assert r.health().num_orphan_stores > 0
    assert (len(r.replays.started), r.health().num_rebuilds) == (num_replays, 0)
    r.clock.now += 61.0
    orphan = BlockStored((9,), 99, tokens(9), BLOCK, Tier.GPU)
    r.pipeline.handle_live(frames(8, events=[orphan]), R1)
    assert r.health().num_rebuilds == 1  # one per cooldown at most


def test_without_replay_a_gap_drops_what_was_credited() -> None:
    r = rig(replay=False)
    r.pipeline.handle_frames([frames(0), frames(1), frames(3)], R1)
    health = r.health()
    assert (health.num_unrepaired_gaps, health.num_history_lost, health.last_seq) == (1, 1, 3)
    assert r.blocks(0, 1) == 0


# --- a replica restarted quiet -------------------------------------------------------------


def test_a_silent_stream_is_probed_and_a_quiet_restart_clears_it() -> None:
    r = rig(probe_interval_s=10.0)
    synced(r, last=2)
    r.clock.now += 9.0
    r.pipeline.maintain()
    num_replays = len(r.replays.started)
    assert r.health().num_probes == 0
    r.clock.now += 1.5
    r.pipeline.maintain()
    assert r.replays.started[num_replays:] == [(R1, REPLAY, 2)]
    assert (r.health().num_probes, r.freshness()) == (1, Freshness.LIVE)
    r.pipeline.on_replay(R1, replies())  # the engine holds nothing at seq 2
    assert r.replays.started[-1] == (R1, REPLAY, 0)
    r.pipeline.on_replay(R1, replies())  # nor from 0: its counter went back
    assert (r.blocks(0, 1, 2), r.health().num_restarts) == (0, 1)


def test_a_probe_answered_by_the_same_engine_keeps_the_stream() -> None:
    r = rig(probe_interval_s=10.0)
    synced(r, last=2)
    r.clock.now += 11.0
    r.pipeline.maintain()
    r.pipeline.on_replay(R1, replies(batch(2)))
    assert (r.blocks(0, 1, 2), r.health().num_restarts) == (3, 0)
    assert r.replays.open == set()


def test_live_batches_disconnects_and_a_zero_interval_hold_probes_back() -> None:
    r = rig(probe_interval_s=10.0)
    synced(r, last=2)
    r.clock.now += 9.0
    r.pipeline.handle_live(frames(3), R1)
    r.clock.now += 9.0
    r.pipeline.maintain()
    assert r.health().num_probes == 0
    r.pipeline.on_disconnected(R1)
    r.clock.now += 30.0
    r.pipeline.maintain()
    assert r.health().num_probes == 0
    off = rig(probe_interval_s=0.0)
    synced(off, last=2)
    off.clock.now += 1000.0
    off.pipeline.maintain()
    assert off.health().num_probes == 0


# --- lag ----------------------------------------------------------------------------------


def test_lag_is_that_of_live_batches_not_of_replayed_ones() -> None:
    r = rig()
    r.pipeline.on_connected(R1)
    old = r.clock.now - 670.0
    r.pipeline.on_replay(R1, replies(batch(0, ts=old), batch(1, ts=old + 1)))
    health = r.health()
    assert (health.last_seq, health.last_event_ts, health.lag_s) == (1, old + 1, None)
    r.pipeline.handle_live(frames(2, ts=r.clock.now - 0.25), R1)
    assert r.health().lag_s == 0.25


def test_close_ends_open_replays() -> None:
    r = rig()
    r.pipeline.on_connected(R1)
    r.pipeline.close()
    assert r.replays.open == set()


@pytest.mark.parametrize("replay", [True, False])
def test_without_a_socket_owner_no_stream_replays(replay: bool) -> None:
    clock = Clock()
    spec = ReplicaSpec("r1", MODEL, replay=REPLAY if replay else None)
    registry = Registry((spec,), clock=clock)
    pipeline = Pipeline(IndexerSettings(replicas=(spec,)), MemoryIndex(), registry, clock=clock)
    pipeline.on_connected(R1)  # not tracked: ignored
    pipeline.track(R1, spec)
    pipeline.on_connected(R1)
    pipeline.handle_frames([frames(0), frames(2)], R1)
    status = registry.status(R1)
    assert status is not None
    assert (status.health.num_replays, status.health.num_unrepaired_gaps) == (0, 1)


def test_a_live_batch_during_a_probe_is_applied_at_once() -> None:
    r = rig(probe_interval_s=10.0)
    synced(r, last=2)
    r.clock.now += 11.0
    r.pipeline.maintain()
    assert r.replays.open == {R1}
    r.pipeline.handle_live(frames(3), R1)
    assert (r.blocks(0, 1, 2, 3), r.health().last_seq) == (4, 3)
    r.pipeline.on_replay(R1, replies())  # the probe's late end: closes it, changes nothing
    assert r.replays.open == set()
    assert (r.blocks(0, 1, 2, 3), r.health().num_restarts) == (4, 0)


# --- after its thread died ------------------------------------------------------------------


def test_a_restart_resyncs_every_stream_from_the_index_by_replay() -> None:
    r = rig()
    synced(r, last=1)
    r.pipeline.handle_frames([frames(3)], R1)  # a gap: a replay from 2 is open
    assert r.replays.open == {R1}
    r.pipeline.restart()  # the thread that ran this pipeline died mid-call
    assert r.replays.open == set()  # its replay closed
    r.pipeline.handle_frames([frames(4)], R1)  # not applied: nothing is trusted yet
    assert r.health().last_seq == 1
    r.clock.now += 1
    r.pipeline.maintain()  # the tracker restarts from the index's watermark, and resyncs
    assert r.replays.started[-1] == (R1, REPLAY, 0)  # the engine's whole buffer
    r.pipeline.on_replay(R1, replies(*(batch(s) for s in range(5))))
    assert r.blocks(0, 1, 2, 3, 4) == 5 and r.health().last_seq == 4
    assert r.health().num_duplicates == 2  # 0 and 1: the index held them already
    assert r.freshness() is Freshness.LIVE


def test_unrouted_totals_go_where_the_caller_says() -> None:
    spec = ReplicaSpec("r1", MODEL)
    settings = IndexerSettings(replicas=(spec,))
    registry = Registry(settings.replicas)
    published: list[UnroutedCounters] = []
    pipeline = Pipeline(settings, MemoryIndex(), registry, publish_unrouted=published.append)
    pipeline.handle_frames([[b"only-one-frame"]], None)
    assert published == [UnroutedCounters(num_undecodable=1)]
    assert registry.unrouted() == UnroutedCounters()  # the sink sums the workers' for it


# --- a partial view: blocks the replica holds that the index never learnt ---------------------


def test_a_partial_view_is_whole_again_after_the_replicas_cache_reset() -> None:
    r = rig()
    synced(r, last=2)
    r.pipeline.handle_live(frames(6), R1)
    r.pipeline.on_replay(R1, replies(batch(5), batch(6)))  # 3 and 4 aged out of the buffer
    since = r.clock.now
    r.clock.now += 5.0
    r.pipeline.handle_frames([frames(7), frames(8)], R1)  # more stores: still partial
    health = r.health()
    assert (r.freshness(), health.partial, health.partial_since) == (
        Freshness.PARTIAL,
        "replay_gap_past_buffer",
        since,
    )
    r.pipeline.handle_frames([frames(9, events=[AllBlocksCleared()]), frames(10)], R1)
    health = r.health()
    assert (r.freshness(), health.partial, health.partial_since) == (Freshness.LIVE, None, None)


def test_a_clear_applied_before_a_gap_leaves_the_view_partial() -> None:
    """The reset's batch is applied before the tracker judges the gap that follows it."""
    r = rig(replay=False)
    r.pipeline.handle_frames([frames(0), frames(1, events=[AllBlocksCleared()]), frames(5)], R1)
    assert (r.freshness(), r.health().partial) == (Freshness.PARTIAL, "gap_unrepaired")


def test_a_stream_begun_past_the_buffer_is_partial_and_one_from_seq_0_is_not() -> None:
    r = rig()
    r.pipeline.on_connected(R1)
    r.pipeline.on_replay(R1, replies(batch(4), batch(5)))  # the buffer starts at seq 4
    assert (r.freshness(), r.health().partial) == (Freshness.PARTIAL, "start_past_buffer")
    whole = rig()
    synced(whole, last=2)
    assert (whole.freshness(), whole.health().partial) == (Freshness.LIVE, None)
    joined = rig(replay=False)
    joined.pipeline.handle_frames([frames(3)], R1)
    assert joined.health().partial == "joined_without_replay"


def test_an_engine_restart_replayed_from_seq_0_makes_a_partial_view_whole() -> None:
    r = rig()
    synced(r, last=2)
    r.pipeline.handle_live(frames(6), R1)
    r.pipeline.on_replay(R1, replies(batch(5), batch(6)))
    assert r.freshness() is Freshness.PARTIAL
    r.pipeline.handle_live(frames(0, ts=500.0), R1)  # seq went back: a restart, replay from 0
    assert r.replays.started[-1] == (R1, REPLAY, 0)
    r.pipeline.on_replay(R1, replies(batch(0, ts=500.0), batch(1, ts=501.0)))
    assert (r.health().num_restarts, r.freshness()) == (1, Freshness.LIVE)


def test_an_engine_restart_past_its_buffer_is_partial() -> None:
    r = rig()
    synced(r, last=8)
    r.pipeline.handle_live(frames(3, ts=500.0), R1)  # seq went back: a restart
    r.pipeline.on_replay(R1, replies(batch(2, ts=499.0), batch(3, ts=500.0)))
    health = r.health()
    assert (health.num_restarts, health.partial) == (1, "restart_past_buffer")


def test_a_purged_stream_back_unchanged_is_partial() -> None:
    r = rig(purge_after_s=30.0)
    synced(r, last=2)
    r.pipeline.on_disconnected(R1)
    r.clock.now += 31.0
    r.pipeline.maintain()
    assert r.blocks(0, 1, 2) == 0
    r.pipeline.on_connected(R1)
    r.pipeline.on_replay(R1, replies(batch(0), batch(1), batch(2)))  # the same engine
    assert (r.freshness(), r.health().partial) == (Freshness.PARTIAL, "purged_while_disconnected")


def test_a_clear_asked_drops_the_blocks_once_without_replay_and_the_view_is_partial() -> None:
    r = rig()
    synced(r, last=2)
    num_replays = len(r.replays.started)
    r.registry.ask_clear("r1", at=5.0)
    r.pipeline.maintain()
    assert r.blocks(0, 1, 2) == 0 and len(r.replays.started) == num_replays
    assert (r.freshness(), r.health().partial) == (Freshness.PARTIAL, "cleared_on_over_predictions")
    r.pipeline.handle_live(frames(3), R1)  # rebuilt from what follows, in order
    r.pipeline.maintain()  # the same ask is not carried out twice
    assert r.health().last_seq == 3 and r.blocks(0, 1, 2) == 0
    assert len(r.replays.started) == num_replays  # its orphan asks no rebuild: it would lie
    r.registry.ask_clear("r1", at=4.0)  # older than the one carried out
    r.pipeline.maintain()
    assert r.health().last_seq == 3


def test_a_store_back_after_an_outage_keeps_the_partial_view() -> None:
    r = rig()
    synced(r, last=2)
    r.pipeline.handle_live(frames(6), R1)
    r.pipeline.on_replay(R1, replies(batch(5), batch(6)))
    r.index.down = True
    r.pipeline.handle_live(frames(7), R1)
    r.index.down = False
    r.pipeline.maintain()
    r.pipeline.on_replay(R1, replies(batch(5), batch(6), batch(7)))
    assert r.health().partial == "replay_gap_past_buffer"


def test_a_stream_resumed_from_a_kept_index_resumes_its_published_partial_view() -> None:
    r = rig()
    synced(r, last=2)
    spec = ReplicaSpec("r1", MODEL, replay=REPLAY)
    config = IndexerSettings(replicas=(spec,))
    for published, expected in ((("gap_unrepaired", 5.0), "gap_unrepaired"), (None, None)):
        registry = Registry(config.replicas, clock=r.clock)
        registry.read_prior_views(lambda _stream, p=published: p)  # type: ignore[misc]
        Pipeline(config, r.index, registry, replays=Replays(), clock=r.clock).track(R1, spec)
        status = registry.status(R1)
        assert status is not None and status.health.partial == expected
    fresh = Registry(config.replicas, clock=r.clock)  # an empty index: judged, not resumed
    fresh.read_prior_views(lambda _stream: ("gap_unrepaired", 5.0))
    Pipeline(config, FlakyIndex(), fresh, replays=Replays(), clock=r.clock).track(R1, spec)
    status = fresh.status(R1)
    assert status is not None and status.health.partial is None
