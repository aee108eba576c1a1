"""Per-stream ordering: seq tracking, gaps, replays, engine restarts; no I/O.

A :class:`StreamTracker` answers each batch with a :class:`Step` (clear, apply, replay).
``seq == last + 1`` applies; a gap replays from ``last + 1``. History no replay can give back
is not credited: the stream is cleared and rebuilt from what follows. A live ``seq <= last``
is a duplicate (same timestamp) or checked by a replay from 0 (without an endpoint: judged by
the next batch); a restart clears the stream. A replay from 0 whose history ends below
``last``, or is empty, shows a restart; a probe of a silent stream replays from ``last``.
:attr:`StreamTracker.partial`: the index may lack blocks (set after a start or clear unless the
next batch is seq 0; cleared by a seq 0 after a clear or an ``AllBlocksCleared`` applied)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from itertools import islice

from kvindex.indexer.domain.events import EventBatch, Numbered
from kvindex.indexer.domain.health import Partial, StreamCounters

_TS_MEMORY = 4096


class Mode(enum.Enum):
    NEW = "new"
    LIVE = "live"
    REPLAYING = "replaying"
    SUSPECT = "suspect"


@dataclass(slots=True)
class Step:
    """What to do, in this order: clear, apply ``batches``, request a replay."""

    clear: bool = False
    batches: list[EventBatch] = field(default_factory=list)
    replay_from: int | None = None
    history_lost: bool = False


@dataclass(slots=True)
class _Replay:
    start: int
    rebuild: bool
    pending: list[EventBatch] = field(default_factory=list)
    skipped: list[EventBatch] = field(default_factory=list)
    """Replayed batches skipped as applied: applied after all if the replay shows a restart."""
    gap_seq: int | None = None
    for_restart: bool = False
    num_received: int = 0
    first_seq: int | None = None
    max_seq: int = -1
    probe: bool = False
    confirmed: bool = False
    doubted: bool = False


class StreamTracker:
    """Ordering state of one stream; one owner. Counts into :attr:`counters`, which the owner
    may swap for a fresh one between calls."""

    def __init__(
        self,
        *,
        can_replay: bool,
        watermark: int = -1,
        last_ts: float | None = None,
        max_pending: int = 100_000,
        counters: StreamCounters | None = None,
    ) -> None:
        self.can_replay = can_replay
        self.last_seq = watermark
        self.partial: str | None = None
        """A :class:`Partial` reason while the index may lack blocks the replica holds."""
        self._judge: str | None = None
        """The reason the next batch applied makes the view partial unless it is seq 0."""
        if watermark < 0:
            begun = Partial.START_PAST_BUFFER if can_replay else Partial.JOINED_WITHOUT_REPLAY
            self._judge = begun.value
        self.mode = Mode.NEW
        self.counters = StreamCounters() if counters is None else counters
        self._seen: dict[int, float] = {}
        if watermark >= 0 and last_ts is not None:
            self._seen[watermark] = last_ts
        self._replay: _Replay | None = None
        self._suspect: EventBatch | None = None
        self._max_pending = max_pending

    @property
    def replaying(self) -> bool:
        return self._replay is not None and not self._replay.probe

    def on_cleared(self) -> None:
        """An ``AllBlocksCleared`` of this stream was applied: the replica's cache was empty
        then, and every batch since is applied, so the view is whole."""
        self.partial = None

    def lose_view(self, reason: Partial) -> None:
        """The index dropped the stream's blocks while the tracker kept its place (a purge)."""
        self.partial = reason.value

    # --- triggers ------------------------------------------------------------------------

    def resync(self, *, rebuild: bool = False) -> Step:
        if not self.can_replay:
            if self._suspect is None:
                self.mode = Mode.LIVE
            return Step()
        if self._replay is not None:
            return Step()
        if rebuild:
            self.counters.num_rebuilds += 1
        return self._start_replay(0, rebuild=rebuild, pending=[])

    def probe(self) -> Step:
        """A silent live stream: ask again for the last applied batch (a no-op without a
        replay endpoint, during a replay, or before anything was applied)."""
        if not self.can_replay or self._replay is not None or self.mode is not Mode.LIVE:
            return Step()
        if self.last_seq < 0:
            return Step()
        self.counters.num_probes += 1
        self._replay = _Replay(self.last_seq, rebuild=False, probe=True)
        self.mode = Mode.REPLAYING
        return Step(replay_from=self.last_seq)

    def accept_next(self, batch: Numbered) -> bool:
        """The common case, kept cheap: True if ``batch`` is the live stream's next one (now
        remembered); False: nothing was done, ask :meth:`on_live`."""
        if self.mode is Mode.LIVE and batch.seq == self.last_seq + 1 and self._replay is None:
            self._remember(batch)
            return True
        return False

    def on_live(self, batch: EventBatch) -> Step:
        if self._replay is not None and self._replay.probe:
            # The stream spoke: its own batches now tell a restart, and they are not held
            # up by a probe (whose late replies are ignored, as an abandoned replay's).
            self._replay = None
            self.mode = Mode.LIVE
        if self.accept_next(batch):
            return Step(batches=[batch])
        if self._replay is not None:
            return self._buffer(batch)
        if self.mode is Mode.NEW and self.can_replay:
            return self._start_replay(0, rebuild=False, pending=[batch])
        if self._suspect is not None:
            return self._judge_suspect(self._suspect, batch)
        self.mode = Mode.LIVE
        return self._live(batch, repair_above=-1)

    def on_replay(self, batch: EventBatch) -> Step:
        replay = self._replay
        if replay is None:
            return Step()  # a late reply of an abandoned replay
        if replay.probe and not replay.confirmed:
            self._probe_answer(replay, batch)
            return Step()
        step = Step()
        if replay.first_seq is None:
            replay.first_seq = batch.seq
            self._first_replayed(replay, batch.seq, step)
        replay.num_received += 1
        replay.max_seq = max(replay.max_seq, batch.seq)
        if batch.seq > self.last_seq:
            self._apply(batch, step)
        elif self._is_known(batch, in_replay=True):
            replay.skipped.append(batch)
        else:
            step = self._restart_with(replay)
            self._apply(batch, step)
        return step

    def on_replay_end(self, *, complete: bool = True) -> Step:
        return self._finish_replay(failed=False, complete=complete)

    def on_replay_failed(self) -> Step:
        return self._finish_replay(failed=True)

    # --- internals -----------------------------------------------------------------------

    def _start_replay(
        self,
        start: int,
        *,
        rebuild: bool,
        pending: list[EventBatch],
        gap_seq: int | None = None,
        for_restart: bool = False,
    ) -> Step:
        self._replay = _Replay(start, rebuild, pending, gap_seq=gap_seq, for_restart=for_restart)
        self.mode = Mode.REPLAYING
        self.counters.num_replays += 1
        return Step(replay_from=start)

    def _buffer(self, batch: EventBatch) -> Step:
        assert self._replay is not None
        self._replay.pending.append(batch)
        if len(self._replay.pending) > self._max_pending:
            return self.on_replay_failed()
        return Step()

    def _first_replayed(self, replay: _Replay, seq: int, step: Step) -> None:
        if seq > replay.start:
            self.counters.num_replay_truncated += 1
        if replay.rebuild and seq == 0:
            self._reset(step, Partial.REPLAY_GAP_PAST_BUFFER)  # seq 0 follows: whole
        elif seq > self.last_seq + 1:
            self._lose_history(step, Partial.REPLAY_GAP_PAST_BUFFER)

    def _probe_answer(self, replay: _Replay, batch: EventBatch) -> None:
        if replay.doubted:
            return
        if batch.seq == self.last_seq and self._seen.get(batch.seq) == batch.ts:
            replay.confirmed = True
            replay.first_seq = replay.max_seq = batch.seq
            replay.num_received += 1
        else:
            replay.doubted = True

    def _lose_history(self, step: Step, reason: Partial) -> None:
        if self.last_seq < 0:
            return
        self.counters.num_history_lost += 1
        self._reset(step, reason)
        self.partial = reason.value  # the replica's cache was not empty at the gap
        step.history_lost = True

    def _live(
        self, batch: EventBatch, *, repair_above: int | None, counted_gap: int | None = None
    ) -> Step:
        seq = batch.seq
        if seq <= self.last_seq:
            return self._backwards(batch)
        # With an endpoint the stream is resynced before it goes live, so even "nothing
        # applied yet" (-1) is a baseline; without one, a first batch may join mid-stream.
        baseline = self.last_seq >= 0 or self.can_replay
        if baseline and seq > self.last_seq + 1:
            start = self.last_seq + 1
            if self.can_replay and repair_above is not None and start > repair_above:
                self.counters.num_gaps += 1
                return self._start_replay(start, rebuild=False, pending=[batch], gap_seq=seq)
            if seq != counted_gap:
                self.counters.num_gaps += 1
            self.counters.num_unrepaired_gaps += 1
            step = Step()
            self._lose_history(step, Partial.GAP_UNREPAIRED)
            self._apply(batch, step)
            return step
        step = Step()
        self._apply(batch, step)
        return step

    def _backwards(self, batch: EventBatch) -> Step:
        if self._is_known(batch, in_replay=False):
            self.counters.num_duplicates += 1
            return Step()
        if self.can_replay:
            return self._start_replay(0, rebuild=False, pending=[batch], for_restart=True)
        self._suspect = batch
        self.mode = Mode.SUSPECT
        return Step()

    def _judge_suspect(self, suspect: EventBatch, batch: EventBatch) -> Step:
        self._suspect = None
        self.mode = Mode.LIVE
        if suspect.seq < batch.seq <= self.last_seq:
            step = self._restart()
            self._apply(suspect, step)
            _then(step, self._live(batch, repair_above=-1))
            return step
        self.counters.num_duplicates += 1
        return self._live(batch, repair_above=-1)

    def _is_known(self, batch: EventBatch, *, in_replay: bool) -> bool:
        """Whether a batch at or below ``last_seq`` was applied (a replayed one whose
        timestamp is forgotten is taken as applied; a live one means a restart)."""
        known_ts = self._seen.get(batch.seq)
        return known_ts == batch.ts or (known_ts is None and in_replay)

    def _restart(self) -> Step:
        self.counters.num_restarts += 1
        step = Step()
        self._reset(step, Partial.RESTART_PAST_BUFFER)
        return step

    def _restart_with(self, replay: _Replay) -> Step:
        step = self._restart()
        for skipped in replay.skipped:
            self._apply(skipped, step)
        replay.skipped.clear()
        return step

    def _reset(self, step: Step, reason: Partial) -> None:
        step.clear = True
        step.batches.clear()
        self.last_seq = -1
        self._seen.clear()
        self._judge = reason.value

    def _apply(self, batch: EventBatch, step: Step) -> None:
        self._remember(batch)
        step.batches.append(batch)

    def _remember(self, batch: Numbered) -> None:
        if self._judge is not None:  # the first batch since a start or a clear
            self.partial = None if batch.seq == 0 else self._judge
            self._judge = None
        self.last_seq = batch.seq
        self.counters.num_batches += 1
        seen = self._seen
        seen[batch.seq] = batch.ts
        if len(seen) > 2 * _TS_MEMORY:
            self._seen = dict(islice(seen.items(), len(seen) - _TS_MEMORY, None))

    def _finish_replay(self, *, failed: bool, complete: bool = True) -> Step:
        replay = self._replay
        if replay is None:
            return Step()
        self._replay = None
        self.mode = Mode.LIVE
        if failed:
            self.counters.num_replay_failures += 1
        elif replay.probe and not replay.confirmed:
            # Empty, or another engine's batch: a replay from 0 tells a restart.
            return self._start_replay(0, rebuild=False, pending=replay.pending)
        step = Step()
        if not failed and self._history_went_back(replay, complete=complete):
            step = self._restart_with(replay)
        self.counters.num_duplicates += len(replay.skipped)
        _then(step, self._drain(replay, failed=failed))
        return step

    def _history_went_back(self, replay: _Replay, *, complete: bool) -> bool:
        """Whether a replay from 0 shows the counter went back: a whole history ending below
        ``last_seq``, or none (a fresh DEALER's first reply is never dropped)."""
        if replay.start != 0 or self.last_seq < 0:
            return False
        if replay.num_received == 0:
            return complete
        return replay.first_seq == 0 and replay.max_seq < self.last_seq

    def _drain(self, replay: _Replay, *, failed: bool) -> Step:
        step = Step()
        repair_above = None if failed else replay.start
        pending = replay.pending
        if replay.for_restart and self._superseded(replay, failed=failed):
            self.counters.num_duplicates += 1
            pending = pending[1:]
        for i, batch in enumerate(pending):
            _then(step, self._live(batch, repair_above=repair_above, counted_gap=replay.gap_seq))
            if self._replay is not None:
                self._replay.pending.extend(pending[i + 1 :])
                break
        return step

    def _superseded(self, replay: _Replay, *, failed: bool) -> bool:
        """Whether the batch that revealed a restart is covered by its replay (judging it
        again could restart forever)."""
        revealing = replay.pending[0]
        return revealing.seq <= self.last_seq or (not failed and replay.num_received > 0)


def _then(step: Step, later: Step) -> None:
    if later.clear:
        step.clear = True
        step.batches.clear()
    step.history_lost = step.history_lost or later.history_lost
    step.batches.extend(later.batches)
    if later.replay_from is not None:
        step.replay_from = later.replay_from
