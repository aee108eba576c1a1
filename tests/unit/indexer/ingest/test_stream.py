"""StreamTracker: the ordering rules of one stream (gaps, replay, restarts, duplicates)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.indexer.domain.events import EventBatch
from kvindex.indexer.ingest.stream import Step, StreamTracker

OLD_TS = 1000.0
NEW_TS = 2000.0


def b(seq: int, ts_base: float = OLD_TS) -> EventBatch:
    """A batch whose ts identifies (engine instance, seq), as vLLM's wall clock does."""
    return EventBatch(seq, ts_base + seq, 0, ())


def apply(*batches: EventBatch) -> Step:
    return Step(batches=list(batches))


def replay(tracker: StreamTracker, *batches: EventBatch) -> list[Step]:
    return [tracker.on_replay(batch) for batch in batches]


def applied(steps: list[Step]) -> list[int]:
    return [batch.seq for step in steps for batch in step.batches]


def live_tracker(last: int) -> StreamTracker:
    """A tracker with an endpoint that has resynced and applied seqs 0..last."""
    tracker = StreamTracker(can_replay=True)
    tracker.resync()
    replay(tracker, *(b(s) for s in range(last + 1)))
    tracker.on_replay_end()
    return tracker


# --- in order, start, resync ----------------------------------------------------------


def test_in_order_stream_without_endpoint_applies_each_batch() -> None:
    tracker = StreamTracker(can_replay=False)
    assert tracker.resync() == Step()
    assert [tracker.on_live(b(s)) for s in range(3)] == [apply(b(0)), apply(b(1)), apply(b(2))]
    assert tracker.last_seq == 2
    assert tracker.counters.num_batches == 3
    assert tracker.counters.num_gaps == tracker.counters.num_replays == 0


def test_accept_next_takes_only_the_next_batch_of_a_live_stream() -> None:
    fresh = StreamTracker(can_replay=True)
    assert not fresh.accept_next(b(0))  # not live yet: on_live decides (a resync)
    assert fresh.last_seq == -1 and fresh.counters.num_batches == 0
    tracker = live_tracker(2)
    assert tracker.accept_next(b(3))
    assert (tracker.last_seq, tracker.counters.num_batches) == (3, 4)
    for other in (b(5), b(3), b(1, NEW_TS)):  # a gap, a duplicate, a restart
        assert not tracker.accept_next(other)
        assert (tracker.last_seq, tracker.counters.num_batches) == (3, 4)
    tracker.on_live(b(5))  # the gap: a replay starts, and live batches are buffered
    assert not tracker.accept_next(b(6))


def test_first_live_frame_without_resync_and_endpoint_is_applied() -> None:
    tracker = StreamTracker(can_replay=False)
    assert tracker.on_live(b(7)) == apply(b(7))
    assert tracker.counters.num_gaps == 0  # nothing before it to miss


def test_first_live_frame_with_endpoint_replays_from_zero() -> None:
    tracker = StreamTracker(can_replay=True)
    assert tracker.on_live(b(3)) == Step(replay_from=0)
    assert tracker.replaying
    assert applied(replay(tracker, b(0), b(1), b(2), b(3))) == [0, 1, 2, 3]
    assert tracker.on_live(b(4)) == Step()  # buffered while replaying
    assert tracker.on_replay_end() == apply(b(4))  # the buffered 3 is deduplicated
    assert not tracker.replaying
    assert tracker.counters.num_replays == 1
    assert tracker.counters.num_duplicates == 1
    assert tracker.counters.num_batches == 5


def test_resync_on_start_replays_from_zero_and_buffers_live() -> None:
    tracker = StreamTracker(can_replay=True)
    assert tracker.resync() == Step(replay_from=0)
    assert tracker.resync() == Step()  # one replay at a time
    assert tracker.on_live(b(2)) == Step()
    assert tracker.on_live(b(3)) == Step()
    assert applied(replay(tracker, b(0), b(1), b(2))) == [0, 1, 2]
    assert tracker.on_replay_end() == apply(b(3))
    assert tracker.counters.num_replays == 1
    assert tracker.counters.num_duplicates == 1


def test_resync_after_reconnect_skips_what_was_applied() -> None:
    tracker = live_tracker(last=4)
    assert tracker.resync() == Step(replay_from=0)
    assert applied(replay(tracker, b(3), b(4), b(5))) == [5]
    assert tracker.on_replay_end() == Step()
    assert tracker.counters.num_restarts == 0
    assert tracker.counters.num_duplicates == 2


# --- gaps -----------------------------------------------------------------------------


def test_gap_replays_from_last_plus_one_then_applies_buffered_deduplicated() -> None:
    tracker = live_tracker(last=2)
    assert tracker.on_live(b(5)) == Step(replay_from=3)
    assert tracker.on_live(b(6)) == Step()
    assert applied(replay(tracker, b(3), b(4), b(5), b(6))) == [3, 4, 5, 6]
    assert tracker.on_live(b(7)) == Step()
    assert tracker.on_replay_end() == apply(b(7))
    counters = tracker.counters
    assert (counters.num_gaps, counters.num_unrepaired_gaps) == (1, 0)
    assert counters.num_duplicates == 2
    assert counters.num_replay_truncated == 0


def test_replay_starting_later_than_asked_is_truncated_and_the_lost_history_cleared() -> None:
    tracker = live_tracker(last=2)
    assert tracker.on_live(b(6)) == Step(replay_from=3)
    steps = replay(tracker, b(5), b(6))
    assert steps[0] == Step(clear=True, batches=[b(5)], history_lost=True)  # 3 and 4 are gone
    assert applied(steps) == [5, 6]
    assert tracker.on_replay_end() == Step()
    counters = tracker.counters
    assert (counters.num_replay_truncated, counters.num_history_lost) == (1, 1)


def test_replay_starting_later_than_asked_but_not_past_what_was_applied_loses_nothing() -> None:
    tracker = live_tracker(last=4)
    assert tracker.resync() == Step(replay_from=0)
    steps = replay(tracker, b(3), b(4), b(5))  # the buffer begins at 3: 0..2 aged out
    assert not any(step.clear for step in steps) and applied(steps) == [5]
    assert tracker.on_replay_end() == Step()
    counters = tracker.counters
    assert (counters.num_replay_truncated, counters.num_history_lost) == (1, 0)


def test_resync_replay_starting_after_zero_is_counted_as_truncated() -> None:
    tracker = StreamTracker(can_replay=True)
    tracker.resync()
    assert applied(replay(tracker, b(10), b(11))) == [10, 11]
    assert tracker.counters.num_replay_truncated == 1


def test_replay_timeout_clears_the_lost_history_and_applies_what_was_buffered() -> None:
    tracker = live_tracker(last=2)
    assert tracker.on_live(b(6)) == Step(replay_from=3)
    tracker.on_live(b(7))
    assert applied(replay(tracker, b(3))) == [3]
    assert tracker.on_replay_failed() == Step(clear=True, batches=[b(6), b(7)], history_lost=True)
    counters = tracker.counters
    assert counters.num_replay_failures == 1
    assert (counters.num_gaps, counters.num_unrepaired_gaps, counters.num_history_lost) == (1, 1, 1)
    assert not tracker.replaying
    assert (tracker.mode.value, tracker.last_seq) == ("live", 7)


def test_replay_timeout_without_a_gap_loses_nothing() -> None:
    tracker = live_tracker(last=2)
    tracker.resync()
    tracker.on_live(b(3))
    assert tracker.on_replay_failed() == apply(b(3))
    assert tracker.counters.num_history_lost == 0


def test_gap_without_endpoint_is_applied_through_and_counted() -> None:
    tracker = StreamTracker(can_replay=False)
    tracker.on_live(b(0))
    tracker.on_live(b(1))
    assert tracker.on_live(b(4)) == Step(clear=True, batches=[b(4)], history_lost=True)
    counters = tracker.counters
    assert (counters.num_gaps, counters.num_unrepaired_gaps, counters.num_history_lost) == (1, 1, 1)
    assert counters.num_replays == 0
    assert tracker.on_live(b(5)) == apply(b(5))


def test_gap_among_buffered_batches_starts_another_replay() -> None:
    tracker = live_tracker(last=2)
    assert tracker.on_live(b(4)) == Step(replay_from=3)
    tracker.on_live(b(6))  # 5 was lost on the live stream during the replay
    assert applied(replay(tracker, b(3), b(4))) == [3, 4]
    assert tracker.on_replay_end() == Step(replay_from=5)
    assert applied(replay(tracker, b(5), b(6))) == [5, 6]
    assert tracker.on_replay_end() == Step()
    assert (tracker.counters.num_gaps, tracker.counters.num_unrepaired_gaps) == (2, 0)


def test_empty_replay_does_not_ask_again_for_the_same_gap() -> None:
    tracker = live_tracker(last=2)
    assert tracker.on_live(b(5)) == Step(replay_from=3)
    assert tracker.on_replay_end() == Step(clear=True, batches=[b(5)], history_lost=True)
    assert (tracker.counters.num_gaps, tracker.counters.num_unrepaired_gaps) == (1, 1)
    assert tracker.counters.num_replays == 2  # the resync and this one


# --- restarts and duplicates ----------------------------------------------------------


def test_backwards_seq_with_new_ts_is_checked_by_replay_which_shows_the_restart() -> None:
    tracker = live_tracker(last=5)
    assert tracker.on_live(b(0, NEW_TS)) == Step(replay_from=0)  # nothing cleared yet
    assert tracker.last_seq == 5
    assert tracker.on_live(b(1, NEW_TS)) == Step()
    steps = replay(tracker, b(0, NEW_TS), b(1, NEW_TS))
    assert steps[0].clear
    assert [batch for step in steps for batch in step.batches] == [b(0, NEW_TS), b(1, NEW_TS)]
    assert tracker.on_replay_end() == Step()
    assert tracker.counters.num_restarts == 1
    assert tracker.last_seq == 1


def test_restart_seen_late_recovers_the_batches_it_missed() -> None:
    tracker = live_tracker(last=5)
    assert tracker.on_live(b(3, NEW_TS)) == Step(replay_from=0)
    assert applied(replay(tracker, *(b(s, NEW_TS) for s in range(4)))) == [0, 1, 2, 3]
    assert tracker.on_replay_end() == Step()


def test_backwards_seq_without_endpoint_is_a_restart_once_the_next_batch_follows_it() -> None:
    tracker = StreamTracker(can_replay=False)
    for seq in range(3):
        tracker.on_live(b(seq))
    assert tracker.on_live(b(0, NEW_TS)) == Step()  # held: the next batch decides
    assert not tracker.accept_next(b(3))
    step = Step(clear=True, batches=[b(0, NEW_TS), b(1, NEW_TS)])
    assert tracker.on_live(b(1, NEW_TS)) == step
    assert tracker.on_live(b(2, NEW_TS)) == apply(b(2, NEW_TS))
    assert (tracker.counters.num_restarts, tracker.counters.num_duplicates) == (1, 0)


def test_a_repeated_live_seq_without_endpoint_is_a_duplicate_whatever_its_payload() -> None:
    tracker = StreamTracker(can_replay=False)
    for seq in range(3):
        tracker.on_live(b(seq))
    assert tracker.on_live(b(2, NEW_TS)) == Step()
    assert tracker.on_live(b(1, NEW_TS)) == Step()  # not after the held 2: judged anew
    assert tracker.on_live(b(3)) == apply(b(3))
    assert (tracker.counters.num_restarts, tracker.counters.num_duplicates) == (0, 2)
    assert tracker.last_seq == 3


def test_a_repeated_live_seq_with_endpoint_is_a_duplicate_when_the_replay_shows_no_restart() -> (
    None
):
    tracker = live_tracker(last=2)
    assert tracker.on_live(b(2, NEW_TS)) == Step(replay_from=0)
    assert applied(replay(tracker, b(0), b(1), b(2))) == []
    assert tracker.on_replay_end() == Step()
    assert tracker.on_live(b(3)) == apply(b(3))
    assert (tracker.counters.num_restarts, tracker.counters.num_duplicates) == (0, 4)


def test_late_live_duplicate_after_replay_overlap_is_not_a_restart() -> None:
    tracker = live_tracker(last=2)
    tracker.on_live(b(4))
    replay(tracker, b(3), b(4), b(5), b(6))
    tracker.on_replay_end()
    assert tracker.on_live(b(5)) == Step()
    assert tracker.on_live(b(6)) == Step()
    assert tracker.on_live(b(7)) == apply(b(7))
    assert tracker.counters.num_restarts == 0
    assert tracker.counters.num_duplicates == 3  # the buffered 4, then the late 5 and 6


def test_a_stale_batch_is_judged_once_by_the_replay_it_started() -> None:
    tracker = live_tracker(last=3)
    stale = b(1, OLD_TS - 500)  # not what this engine published as seq 1
    assert tracker.on_live(stale) == Step(replay_from=0)
    assert applied(replay(tracker, *(b(s) for s in range(4)))) == []  # the same history
    assert tracker.on_replay_end() == Step()  # no restart, no second replay: no loop
    assert not tracker.replaying
    assert tracker.counters.num_restarts == 0


def test_after_an_empty_resync_a_later_seq_is_a_gap() -> None:
    tracker = StreamTracker(can_replay=True)
    tracker.resync()
    assert tracker.on_replay_end() == Step()
    assert tracker.on_live(b(1)) == Step(replay_from=0)
    assert tracker.counters.num_gaps == 1


def test_restart_among_buffered_batches_clears_and_resyncs() -> None:
    tracker = live_tracker(last=2)
    tracker.on_live(b(4))
    tracker.on_live(b(0, NEW_TS))
    replay(tracker, b(3), b(4))
    assert tracker.on_replay_end() == Step(replay_from=0)  # to check b(0, NEW_TS)
    steps = replay(tracker, b(0, NEW_TS), b(1, NEW_TS))
    assert steps[0].clear and applied(steps) == [0, 1]
    assert tracker.on_replay_end() == Step()
    assert tracker.counters.num_restarts == 1


def test_restart_after_a_failed_replay_still_resyncs() -> None:
    tracker = live_tracker(last=2)
    tracker.on_live(b(5))
    tracker.on_live(b(0, NEW_TS))
    assert tracker.on_replay_failed() == Step(
        clear=True, batches=[b(5)], replay_from=0, history_lost=True
    )
    assert (tracker.counters.num_unrepaired_gaps, tracker.counters.num_history_lost) == (1, 1)


# --- indexer restart: watermark from the index -----------------------------------------


def test_watermark_replay_skips_batches_already_in_the_index() -> None:
    tracker = StreamTracker(can_replay=True, watermark=5, last_ts=b(5).ts)
    assert tracker.resync() == Step(replay_from=0)
    assert applied(replay(tracker, *(b(s) for s in range(8)))) == [6, 7]
    assert tracker.on_replay_end() == Step()
    assert tracker.counters.num_duplicates == 6
    assert tracker.counters.num_restarts == 0


def test_watermark_seq_with_other_ts_in_replay_is_a_restart() -> None:
    tracker = StreamTracker(can_replay=True, watermark=5, last_ts=b(5).ts)
    tracker.resync()
    steps = replay(tracker, *(b(s, NEW_TS) for s in range(7)))
    assert applied(steps[:5]) == []
    assert steps[5].clear
    # every replayed batch came from the restarted engine, the skipped ones included
    assert applied(steps[5:]) == [0, 1, 2, 3, 4, 5, 6]
    assert tracker.on_replay_end() == Step()
    assert tracker.counters.num_restarts == 1
    assert tracker.counters.num_duplicates == 0


def test_replay_ending_below_the_watermark_is_a_restart() -> None:
    tracker = StreamTracker(can_replay=True, watermark=5, last_ts=b(5).ts)
    tracker.resync()
    tracker.on_live(b(2, NEW_TS))
    assert applied(replay(tracker, b(0, NEW_TS), b(1, NEW_TS), b(2, NEW_TS))) == []
    end = tracker.on_replay_end()
    assert end == Step(clear=True, batches=[b(0, NEW_TS), b(1, NEW_TS), b(2, NEW_TS)])
    assert tracker.counters.num_restarts == 1
    assert tracker.on_live(b(3, NEW_TS)) == apply(b(3, NEW_TS))


def test_replay_of_a_partial_history_ending_below_the_watermark_is_not_a_restart() -> None:
    tracker = StreamTracker(can_replay=True, watermark=5, last_ts=b(5).ts)
    tracker.resync()
    assert applied(replay(tracker, b(2), b(3), b(4))) == []  # its tail was lost
    assert tracker.on_replay_end() == Step()
    assert tracker.counters.num_restarts == 0


def test_an_empty_replay_from_zero_is_a_restarted_engine_that_holds_nothing() -> None:
    tracker = StreamTracker(can_replay=True, watermark=5, last_ts=b(5).ts)
    tracker.resync()
    assert tracker.on_replay_end() == Step(clear=True)
    assert (tracker.counters.num_restarts, tracker.last_seq) == (1, -1)
    assert tracker.on_live(b(0, NEW_TS)) == apply(b(0, NEW_TS))


def test_an_empty_replay_with_undecodable_replies_proves_nothing() -> None:
    tracker = live_tracker(last=5)
    tracker.resync()
    assert tracker.on_replay_end(complete=False) == Step()
    assert (tracker.counters.num_restarts, tracker.last_seq) == (0, 5)


def test_an_empty_replay_from_zero_before_anything_was_applied_clears_nothing() -> None:
    tracker = StreamTracker(can_replay=True)
    tracker.resync()
    assert tracker.on_replay_end() == Step()
    assert tracker.counters.num_restarts == 0


def test_an_empty_gap_replay_is_no_restart() -> None:
    tracker = live_tracker(last=5)
    assert tracker.on_live(b(7)) == Step(replay_from=6)
    assert tracker.on_replay_end().clear  # the gap's history is lost, not the engine
    assert (tracker.counters.num_restarts, tracker.counters.num_history_lost) == (0, 1)


# --- seq-reset probe of a silent stream ------------------------------------------------


def test_a_probe_answered_by_the_same_engine_changes_nothing() -> None:
    tracker = live_tracker(last=5)
    assert tracker.probe() == Step(replay_from=5)
    assert not tracker.replaying  # a probe is not shown as a replay
    assert applied(replay(tracker, b(5), b(6))) == [6]  # and it repairs what was missed
    assert tracker.on_replay_end() == Step()
    counters = tracker.counters
    assert (counters.num_probes, counters.num_restarts, counters.num_replays) == (1, 0, 1)
    assert tracker.accept_next(b(7))


def test_a_probe_answered_empty_is_checked_from_zero_which_clears() -> None:
    tracker = live_tracker(last=5)
    tracker.probe()
    assert tracker.on_replay_end() == Step(replay_from=0)
    assert tracker.replaying
    assert tracker.on_replay_end() == Step(clear=True)  # the engine holds no history
    assert (tracker.counters.num_restarts, tracker.last_seq) == (1, -1)


def test_a_probe_answered_by_another_engine_is_checked_from_zero() -> None:
    tracker = live_tracker(last=5)
    tracker.probe()
    assert replay(tracker, b(5, NEW_TS), b(6, NEW_TS)) == [Step(), Step()]
    assert tracker.last_seq == 5  # nothing applied on a doubted probe's word
    assert tracker.on_replay_end() == Step(replay_from=0)
    steps = replay(tracker, *(b(s, NEW_TS) for s in range(7)))
    assert steps[0].clear and applied(steps) == [0, 1, 2, 3, 4, 5, 6]
    assert tracker.on_replay_end() == Step()
    assert tracker.counters.num_restarts == 1


def test_a_probe_of_a_stream_that_cannot_or_need_not_be_probed_is_a_no_op() -> None:
    assert StreamTracker(can_replay=False).probe() == Step()
    assert StreamTracker(can_replay=True).probe() == Step()  # not live yet
    fresh = live_tracker(last=-1)
    assert fresh.probe() == Step()  # nothing applied: nothing to ask about
    busy = live_tracker(last=3)
    busy.on_live(b(6))  # a gap replay is open
    assert busy.probe() == Step()
    assert busy.counters.num_probes == 0


def test_a_live_batch_during_a_probe_ends_it_and_is_applied_at_once() -> None:
    tracker = live_tracker(last=5)
    tracker.probe()
    assert tracker.on_live(b(6)) == apply(b(6))
    assert replay(tracker, b(5, NEW_TS)) == [Step()]  # a late reply: ignored
    assert tracker.on_replay_end() == Step()
    assert (tracker.last_seq, tracker.counters.num_restarts) == (6, 0)
    assert tracker.accept_next(b(7))


# --- rebuilds, late replies, overflow ------------------------------------------------


def test_rebuild_from_seq_zero_clears_then_applies_everything() -> None:
    tracker = live_tracker(last=3)
    assert tracker.resync(rebuild=True) == Step(replay_from=0)
    steps = replay(tracker, b(0), b(1), b(2), b(3))
    assert steps[0] == Step(clear=True, batches=[b(0)])
    assert applied(steps) == [0, 1, 2, 3]
    assert tracker.on_replay_end() == Step()
    assert tracker.counters.num_rebuilds == 1
    assert tracker.counters.num_restarts == 0


def test_rebuild_with_truncated_history_does_not_clear() -> None:
    tracker = live_tracker(last=3)
    tracker.resync(rebuild=True)
    steps = replay(tracker, b(2), b(3), b(4))
    assert not any(step.clear for step in steps)
    assert applied(steps) == [4]
    assert tracker.counters.num_replay_truncated == 1


def test_late_replay_replies_after_the_end_are_ignored() -> None:
    tracker = live_tracker(last=2)
    before = tracker.counters
    before_fields = (before.num_batches, before.num_duplicates, before.num_restarts)
    assert tracker.on_replay(b(0, NEW_TS)) == Step()
    assert tracker.on_replay(b(9)) == Step()
    assert tracker.on_replay_end() == Step()
    assert tracker.on_replay_failed() == Step()
    after = tracker.counters
    assert (after.num_batches, after.num_duplicates, after.num_restarts) == before_fields
    assert after.num_replay_failures == 0
    assert tracker.last_seq == 2


def test_pending_overflow_ends_the_replay_as_failed() -> None:
    tracker = StreamTracker(can_replay=True, max_pending=2)
    tracker.resync()
    assert tracker.on_live(b(0)) == Step()
    assert tracker.on_live(b(1)) == Step()
    assert tracker.on_live(b(2)) == apply(b(0), b(1), b(2))
    assert not tracker.replaying
    assert tracker.counters.num_replay_failures == 1
    assert tracker.on_replay(b(0)) == Step()  # the abandoned replay's late reply


# --- property: replayed gaps give the publisher's exact sequence ----------------------

PUBLISH, TICK, RESTART = "publish", "tick", "restart"


@dataclass(frozen=True)
class Action:
    kind: str
    drop: bool = False
    dup: int | None = None
    """Also deliver again the batch at this index (mod count) of the current engine."""


@dataclass
class Request:
    start: int
    instance: int
    due: int


@dataclass
class Fleet:
    """One publisher (restartable, unbounded replay buffer) and an index fed by the tracker."""

    delay: int
    instance: int = 0
    published: list[EventBatch] = field(default_factory=list)
    index: list[tuple[int, float]] = field(default_factory=list)
    request: Request | None = None
    now: int = 0
    num_served: int = 0

    def publish(self) -> EventBatch:
        seq = len(self.published)
        batch = EventBatch(seq, self.instance * 1e6 + seq, 0, ())
        self.published.append(batch)
        return batch

    def restart(self, tracker: StreamTracker) -> None:
        """The engine is down for longer than a replay timeout, then comes back at seq 0.

        (Seqs alone cannot tell two restarts within one replay apart; vLLM takes far
        longer than a replay timeout to start.)
        """
        while self.request is not None:
            self.request = None
            self.run(tracker, tracker.on_replay_failed())
        self.instance += 1
        self.published = []

    def run(self, tracker: StreamTracker, step: Step) -> None:
        if step.clear:
            self.index.clear()
        self.index.extend((batch.seq, batch.ts) for batch in step.batches)
        if step.replay_from is not None:
            assert self.request is None
            self.request = Request(step.replay_from, self.instance, self.now + self.delay)

    def serve(self, tracker: StreamTracker, *, force: bool = False) -> None:
        """Answer the replay when due; a request sent to an engine that has since restarted
        is lost with its connection and times out."""
        while self.request is not None and (force or self.request.due <= self.now):
            self.num_served += 1
            assert self.num_served < 1000, "replay loop"
            request, self.request = self.request, None
            if request.instance != self.instance:
                self.run(tracker, tracker.on_replay_failed())
                continue
            for batch in self.published[request.start :]:
                self.run(tracker, tracker.on_replay(batch))
            self.run(tracker, tracker.on_replay_end())
        assert tracker.replaying == (self.request is not None)


def play(
    fleet: Fleet, tracker: StreamTracker, actions: list[Action], *, must_deliver: bool
) -> None:
    """Publish and deliver; ``must_deliver``: the next batch is not lost.

    A restart is visible only as the seq going back (vLLM sends no hello), so the first
    batch after one is never lost unless a replay can show it.
    """
    for action in actions:
        fleet.now += 1
        if action.kind == RESTART:
            fleet.restart(tracker)
            must_deliver = True
        elif action.kind == PUBLISH:
            batch = fleet.publish()
            if must_deliver or not action.drop:
                fleet.run(tracker, tracker.on_live(batch))
                must_deliver = False
            if action.dup is not None:
                again = fleet.published[action.dup % len(fleet.published)]
                fleet.run(tracker, tracker.on_live(again))
        fleet.serve(tracker)
    fleet.run(tracker, tracker.on_live(fleet.publish()))  # the tail is never lost
    fleet.serve(tracker, force=True)


actions_strategy = st.lists(
    st.builds(
        Action,
        kind=st.sampled_from([PUBLISH] * 6 + [TICK] * 2 + [RESTART]),
        drop=st.booleans(),
        dup=st.none() | st.none() | st.integers(0, 40),
    ),
    max_size=40,
)


@settings(max_examples=400, deadline=None)
@given(
    actions=actions_strategy,
    num_preloaded=st.integers(0, 4),
    num_while_down=st.integers(0, 4),
    restart_while_down=st.booleans(),
    delay=st.integers(0, 3),
    resync_first=st.booleans(),
)
def test_replayed_gaps_reproduce_the_publisher_sequence(
    actions: list[Action],
    num_preloaded: int,
    num_while_down: int,
    restart_while_down: bool,
    delay: int,
    resync_first: bool,
) -> None:
    fleet = Fleet(delay)
    for _ in range(num_preloaded):  # applied by this indexer before it restarted
        fleet.index.append(_key(fleet.publish()))
    last_ts = fleet.index[-1][1] if fleet.index else None
    tracker = StreamTracker(can_replay=True, watermark=num_preloaded - 1, last_ts=last_ts)
    if restart_while_down:
        fleet.restart(tracker)
    for _ in range(num_while_down):
        fleet.publish()
    if resync_first:
        fleet.run(tracker, tracker.resync())
    play(fleet, tracker, actions, must_deliver=restart_while_down and num_while_down == 0)

    assert fleet.index == [_key(batch) for batch in fleet.published]
    assert not tracker.replaying
    if fleet.instance == 0:
        assert tracker.counters.num_unrepaired_gaps == 0
        assert tracker.counters.num_replay_failures == 0


def _key(batch: EventBatch) -> tuple[int, float]:
    return (batch.seq, batch.ts)


# --- the view: partial until every batch since an empty cache is applied --------------------


def test_history_lost_makes_the_view_partial_at_once_and_a_reset_event_whole() -> None:
    tracker = live_tracker(2)
    tracker.on_live(b(6))
    step = tracker.on_replay(b(5))  # 3 and 4 are gone from the buffer
    assert step.clear and tracker.partial == "replay_gap_past_buffer"
    tracker.on_replay(b(6))
    tracker.on_replay_end()
    assert tracker.partial == "replay_gap_past_buffer"
    tracker.on_cleared()
    assert tracker.partial is None


def test_the_first_batch_after_a_restart_judges_the_view() -> None:
    from_zero = live_tracker(4)
    from_zero.on_live(b(0, NEW_TS))
    from_zero.on_replay(b(0, NEW_TS))
    assert from_zero.partial is None  # the new engine's history from its start
    past = live_tracker(4)
    past.on_live(b(2, NEW_TS))
    past.on_replay(b(1, NEW_TS))
    assert past.partial == "restart_past_buffer"


def test_a_tracker_begun_on_a_watermark_is_whole_and_one_begun_empty_is_judged() -> None:
    assert StreamTracker(can_replay=True, watermark=7, last_ts=OLD_TS + 7).partial is None
    fresh = StreamTracker(can_replay=False)
    fresh.on_live(b(0))
    assert fresh.partial is None
    joined = StreamTracker(can_replay=False)
    joined.on_live(b(3))
    assert joined.partial == "joined_without_replay"
