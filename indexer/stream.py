"""Per-stream ordering: sequence tracking, gaps, replay, engine restarts. No I/O here.

A :class:`StreamTracker` sees every live batch and every replayed batch of one stream
(replica, data-parallel rank) and answers with a :class:`Step`: whether to clear the
stream, which batches to apply (in order), and whether to ask for a replay. The
subscriber carries the step out. Rules:

* ``seq == last + 1`` → apply. ``seq > last + 1`` → a gap: replay from ``last + 1``,
  buffering live batches meanwhile; they are applied after the replay, deduplicated by seq.
* ``seq <= last`` on the live stream is a duplicate only if it is a batch already seen
  (same seq *and* same engine timestamp, as after a replay overlap); otherwise the engine
  restarted (vLLM restarts its counter at 0): clear the stream and resync.
* On start or reconnect the stream resyncs: replay from the oldest available batch (0);
  batches at or below what was applied are skipped, unless their timestamp shows that the
  engine restarted meanwhile.
* A *rebuild* (to repair orphaned stores) also replays from 0; if the engine still holds
  its whole history (the replay starts at seq 0), the stream is cleared and rebuilt.
* Without a replay endpoint, gaps are applied through and counted as unrepaired.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from indexer.events import EventBatch

_TS_MEMORY = 4096
"""How many recent (seq, ts) pairs are kept to tell a duplicate from a restart."""


class Mode(enum.Enum):
    NEW = "new"
    LIVE = "live"
    REPLAYING = "replaying"


@dataclass(slots=True)
class Step:
    """What to do, in this order: clear, apply ``batches``, request a replay."""

    clear: bool = False
    batches: list[EventBatch] = field(default_factory=list)
    replay_from: int | None = None


@dataclass(slots=True)
class StreamCounters:
    num_batches: int = 0
    num_gaps: int = 0
    num_unrepaired_gaps: int = 0
    num_replays: int = 0
    num_replay_failures: int = 0
    num_replay_truncated: int = 0
    num_restarts: int = 0
    num_duplicates: int = 0
    num_rebuilds: int = 0


@dataclass(slots=True)
class _Replay:
    start: int
    rebuild: bool
    pending: list[EventBatch] = field(default_factory=list)
    num_received: int = 0


class StreamTracker:
    """Ordering state of one stream. Not thread-safe: one owner (the subscriber loop)."""

    def __init__(
        self,
        *,
        can_replay: bool,
        watermark: int = -1,
        last_ts: float | None = None,
        max_pending: int = 100_000,
    ) -> None:
        self.can_replay = can_replay
        self.last_seq = watermark
        self.mode = Mode.NEW
        self.counters = StreamCounters()
        self._seen: dict[int, float] = {}
        if watermark >= 0 and last_ts is not None:
            self._seen[watermark] = last_ts
        self._replay: _Replay | None = None
        self._max_pending = max_pending

    @property
    def replaying(self) -> bool:
        return self._replay is not None

    # --- triggers ------------------------------------------------------------------------

    def resync(self, *, rebuild: bool = False) -> Step:
        """Start (or reconnect): replay from the oldest batch the engine still buffers."""
        if not self.can_replay:
            self.mode = Mode.LIVE
            return Step()
        if self._replay is not None:
            return Step()
        if rebuild:
            self.counters.num_rebuilds += 1
        return self._start_replay(0, rebuild=rebuild, pending=[])

    def on_live(self, batch: EventBatch) -> Step:
        if self._replay is not None:
            return self._buffer(batch)
        if self.mode is Mode.NEW and self.can_replay:
            return self._start_replay(0, rebuild=False, pending=[batch])
        self.mode = Mode.LIVE
        return self._live(batch, during_drain=False)

    def on_replay(self, batch: EventBatch) -> Step:
        replay = self._replay
        if replay is None:
            return Step()  # a late reply of an abandoned replay
        step = Step()
        if replay.num_received == 0:
            self._first_replayed(replay, batch.seq, step)
        replay.num_received += 1
        self._accept(batch, step, in_replay=True)
        return step

    def on_replay_end(self) -> Step:
        return self._finish_replay(failed=False)

    def on_replay_failed(self) -> Step:
        """The replay timed out or its socket failed: apply what was buffered, count it."""
        return self._finish_replay(failed=True)

    # --- internals -----------------------------------------------------------------------

    def _start_replay(self, start: int, *, rebuild: bool, pending: list[EventBatch]) -> Step:
        self._replay = _Replay(start, rebuild, pending)
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
            self._reset(step)

    def _live(self, batch: EventBatch, *, during_drain: bool) -> Step:
        step = Step()
        seq = batch.seq
        if self.last_seq >= 0 and seq > self.last_seq + 1:
            self.counters.num_gaps += 1
            if self.can_replay and not during_drain:
                return self._start_replay(self.last_seq + 1, rebuild=False, pending=[batch])
            self.counters.num_unrepaired_gaps += 1
        restarted = self._accept(batch, step, in_replay=False)
        if restarted and self.can_replay and not during_drain:
            step.batches.clear()
            resync = self._start_replay(0, rebuild=False, pending=[batch])
            step.replay_from = resync.replay_from
        return step

    def _accept(self, batch: EventBatch, step: Step, *, in_replay: bool) -> bool:
        """Apply, skip as a duplicate, or (for a backwards seq) treat as a restart.

        Returns True when a restart was detected (the step then clears the stream).
        A replayed batch at or below ``last_seq`` whose timestamp is no longer remembered is
        taken as already applied; on the live stream it means the engine restarted.
        """
        restarted = False
        if batch.seq <= self.last_seq:
            known_ts = self._seen.get(batch.seq)
            if known_ts == batch.ts or (known_ts is None and in_replay):
                self.counters.num_duplicates += 1
                return False
            self.counters.num_restarts += 1
            self._reset(step)
            restarted = True
        self._remember(batch)
        step.batches.append(batch)
        return restarted

    def _reset(self, step: Step) -> None:
        step.clear = True
        step.batches.clear()
        self.last_seq = -1
        self._seen.clear()

    def _remember(self, batch: EventBatch) -> None:
        self.last_seq = batch.seq
        self.counters.num_batches += 1
        seen = self._seen
        seen[batch.seq] = batch.ts
        if len(seen) > _TS_MEMORY:
            del seen[next(iter(seen))]

    def _finish_replay(self, *, failed: bool) -> Step:
        replay = self._replay
        if replay is None:
            return Step()
        self._replay = None
        self.mode = Mode.LIVE
        if failed:
            self.counters.num_replay_failures += 1
        step = Step()
        for batch in replay.pending:
            drained = self._live(batch, during_drain=True)
            if drained.clear:
                step.clear = True
                step.batches.clear()
            step.batches.extend(drained.batches)
        return step
