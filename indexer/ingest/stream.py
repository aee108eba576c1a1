"""Per-stream ordering: sequence tracking, gaps, replay, engine restarts. No I/O here.

A :class:`StreamTracker` sees every live batch and every replayed batch of one stream
(replica, data-parallel rank) and answers with a :class:`Step`: whether to clear the
stream, which batches to apply (in order), and whether to ask for a replay. The
pipeline carries the step out. Rules:

* ``seq == last + 1`` → apply. ``seq > last + 1`` → a gap: replay from ``last + 1``,
  buffering live batches meanwhile; they are applied after the replay, deduplicated by seq.
  A gap found among the buffered batches starts another replay, unless the replay failed
  or the gap begins where the replay began (it had nothing to give): then it is counted
  as unrepaired and its history as lost (below).
* **History that cannot be repaired is not credited.** A gap no replay can fill (no
  replay endpoint; a replay that failed or timed out; a replay that begins later than
  ``last + 1``, the engine's buffer no longer reaching back) clears the stream, counted
  ``num_history_lost``, and it is rebuilt from what the replica still sends: the truncated
  replay's batches, then the live ones. Why clear rather than keep: the missing batches
  may have removed blocks the index still credits, and nothing can tell which; a block
  missed costs a cache hit, a block wrongly credited sends a request to a replica that
  recomputes it. After the clear every credited block is one seen stored since. Stores
  that follow may name parents lost with that history (orphans): the pipeline starts
  the rebuild cooldown at the clear, so orphan repair cannot loop on them.
* ``seq <= last`` on the live stream is either a duplicate or the first batch heard from a
  restarted engine (vLLM restarts its counter at 0; its first batches may be lost before
  the socket connects, so the seq seen may be above 0). The live batch alone cannot tell
  (a peer may repeat a seq with any payload), so nothing is cleared on its word:

  - a batch already seen (same seq *and* same engine timestamp, as after a replay
    overlap) is a duplicate: counted and dropped;
  - otherwise, with a replay endpoint, the stream is checked by a replay from 0 (nothing
    cleared meanwhile): the engine's own history shows a restart (a remembered seq with
    another timestamp, or a whole history that ends below ``last``), and then the stream
    is cleared and rebuilt from it; if it shows none, the batch was a duplicate;
  - without one, the batch is held and the next live batch decides: if it follows the
    held one and is still at or below ``last`` (the counter moves on from the low seq),
    the engine restarted: clear, apply both. Anything else (e.g. ``last + 1``: the old
    counter goes on) makes the held batch a duplicate, counted and dropped. A restart
    whose first batches were all lost and whose counter meets the old one exactly at
    ``last`` is then taken for a duplicate: only a replay endpoint can see it.
* On start or reconnect the stream resyncs: replay from the oldest available batch (0);
  batches at or below what was applied are skipped, unless the engine restarted meanwhile,
  shown by a timestamp that differs from the one remembered for that seq, by a replay
  of the whole history (from seq 0) that ends below what was applied, or by a replay from
  0 that returns nothing at all (end marker only) while something was applied: an engine
  that ever sent a batch keeps its newest ones buffered, so an empty buffer is a
  restarted one (a replica restarted but quiet). Then the stream is cleared (a restart)
  and every batch of that replay is applied (they all come from the restarted engine).
  The empty case is safe under vLLM < 0.33's lost tails (the ROUTER drops what overflows
  its send limit): the first reply into a fresh DEALER's pipe is never dropped, and a
  replay whose replies were undecodable proves nothing. (An engine run with
  ``buffer_steps = 0`` always answers empty: each resync, and each probe, clears it.) A
  batch that revealed a restart is judged once: the replay it started supersedes it.
* A *probe* checks a silent stream for a seq reset (bind mode, or a reconnect the socket
  monitor missed): a replay from ``last``. The same engine answers with that very batch
  (same seq and timestamp) and anything newer, applied; an empty answer or another batch
  starts a replay from 0, which decides as above. A live batch during a probe ends it
  (the stream is not silent). The pipeline probes a stream silent for
  ``probe_interval_s``, so a replica restarted quiet loses its old blocks within that
  interval, a maintenance tick (1 s) and two replays (at worst ``replay_timeout_s`` each;
  a live engine answers in milliseconds).
* A *rebuild* (to repair orphaned stores) also replays from 0; if the engine still holds
  its whole history (the replay starts at seq 0), the stream is cleared and rebuilt.
* Without a replay endpoint, a gap is counted as unrepaired and loses the history (above),
  and a confirmed restart (above) clears the stream and applies the batches.
* A replay that starts later than asked is counted as truncated; what it returns is
  applied, after a clear when it begins past ``last + 1`` (lost history).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from itertools import islice

from kvindex.indexer.domain.events import EventBatch, Numbered
from kvindex.indexer.domain.health import StreamCounters

_TS_MEMORY = 4096
"""How many recent (seq, ts) pairs are kept, at least, to tell a duplicate from a restart.
Up to twice as many are held: they are trimmed in bulk (deleting a dict's oldest entry one
at a time costs a scan over the holes left by earlier deletions)."""


class Mode(enum.Enum):
    NEW = "new"
    LIVE = "live"
    REPLAYING = "replaying"
    SUSPECT = "suspect"
    """A backwards live batch is held until the next one tells a restart from a duplicate
    (no replay endpoint). Not LIVE, so :meth:`StreamTracker.accept_next` declines."""


@dataclass(slots=True)
class Step:
    """What to do, in this order: clear, apply ``batches``, request a replay."""

    clear: bool = False
    batches: list[EventBatch] = field(default_factory=list)
    replay_from: int | None = None
    history_lost: bool = False
    """The clear drops history no replay could give back (counted ``num_history_lost``):
    stores that follow may name parents the index never sees again."""


@dataclass(slots=True)
class _Replay:
    start: int
    rebuild: bool
    pending: list[EventBatch] = field(default_factory=list)
    """Live batches that arrived meanwhile, applied (deduplicated) when the replay ends."""
    skipped: list[EventBatch] = field(default_factory=list)
    """Replayed batches skipped as already applied. Every replayed batch comes from the
    engine as it is now, so if the replay reveals a restart these are applied after all."""
    gap_seq: int | None = None
    """Seq of the live batch whose gap started this replay (that gap is already counted)."""
    for_restart: bool = False
    """Started to check whether ``pending[0]`` (a backwards batch) means a restart; the
    replay supersedes that batch."""
    num_received: int = 0
    first_seq: int | None = None
    max_seq: int = -1
    probe: bool = False
    """A seq-reset probe: asked from ``last_seq``, whose batch must come back first, as
    remembered, for the engine to be the same one."""
    confirmed: bool = False
    """A probe whose first reply was the remembered batch."""
    doubted: bool = False
    """A probe whose first reply was another batch: the rest is ignored, a check from 0
    decides."""


class StreamTracker:
    """Ordering state of one stream. Not thread-safe: one owner (the pipeline).

    It counts batches, gaps, replays, restarts and duplicates into :attr:`counters`, which
    its owner may swap for a fresh one between calls (the pipeline hands each stream's
    counts to the registry that way); left alone, they are running totals.
    """

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
        """Whether a replay is open, other than a probe (a probe changes nothing unless it
        finds a restart, which it hands to a replay from 0)."""
        return self._replay is not None and not self._replay.probe

    # --- triggers ------------------------------------------------------------------------

    def resync(self, *, rebuild: bool = False) -> Step:
        """Start (or reconnect): replay from the oldest batch the engine still buffers."""
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
        """A silent live stream: ask the engine again for the last applied batch.

        The engine that sent it answers with it (same seq, same timestamp) and anything
        newer; an empty answer or another batch means its counter went back, and a replay
        from 0 follows to decide, as the module's rules say. A no-op (an empty step) without
        a replay endpoint, during a replay, or before anything was applied.
        """
        if not self.can_replay or self._replay is not None or self.mode is not Mode.LIVE:
            return Step()
        if self.last_seq < 0:
            return Step()
        self.counters.num_probes += 1
        self._replay = _Replay(self.last_seq, rebuild=False, probe=True)
        self.mode = Mode.REPLAYING
        return Step(replay_from=self.last_seq)

    def accept_next(self, batch: Numbered) -> bool:
        """The common case, kept cheap: the next batch of a live stream is remembered and
        True is returned (apply it). False: nothing was done; ask :meth:`on_live`."""
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
        """The end marker came. ``complete=False``: some replies were undecodable, so an
        empty replay does not prove an empty engine buffer."""
        return self._finish_replay(failed=False, complete=complete)

    def on_replay_failed(self) -> Step:
        """The replay timed out or its socket failed: apply what was buffered, count it."""
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
            self._reset(step)
        elif seq > self.last_seq + 1:
            self._lose_history(step)

    def _probe_answer(self, replay: _Replay, batch: EventBatch) -> None:
        """The first reply to a probe confirms the engine or casts doubt on it."""
        if replay.doubted:
            return
        if batch.seq == self.last_seq and self._seen.get(batch.seq) == batch.ts:
            replay.confirmed = True
            replay.first_seq = replay.max_seq = batch.seq
            replay.num_received += 1
        else:
            replay.doubted = True

    def _lose_history(self, step: Step) -> None:
        """A gap no replay can fill: clear what the stream credited (if anything), so that
        every block it credits from now on is one seen stored since."""
        if self.last_seq < 0:
            return
        self.counters.num_history_lost += 1
        self._reset(step)
        step.history_lost = True

    def _live(
        self, batch: EventBatch, *, repair_above: int | None, counted_gap: int | None = None
    ) -> Step:
        """Apply a live (or drained) batch.

        A gap starting above ``repair_above`` starts a replay (``None``: never, as after a
        failed replay); a restart always does when the stream can replay.
        """
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
            self._lose_history(step)
            self._apply(batch, step)
            return step
        step = Step()
        self._apply(batch, step)
        return step

    def _backwards(self, batch: EventBatch) -> Step:
        """A live batch at or below ``last_seq``: a duplicate, or a restarted engine's.

        Nothing is cleared yet: a replay from 0 (with an endpoint) or the next live batch
        (without) decides, as the module's rules say."""
        if self._is_known(batch, in_replay=False):
            self.counters.num_duplicates += 1
            return Step()
        if self.can_replay:
            return self._start_replay(0, rebuild=False, pending=[batch], for_restart=True)
        self._suspect = batch
        self.mode = Mode.SUSPECT
        return Step()

    def _judge_suspect(self, suspect: EventBatch, batch: EventBatch) -> Step:
        """The live batch after a held backwards one: a restart if the counter moves on
        from the held seq while still at or below ``last_seq``; else the held one was a
        duplicate."""
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
        """Whether a batch at or below ``last_seq`` was already applied.

        A replayed batch whose timestamp is no longer remembered is taken as applied; on the
        live stream it means the engine restarted.
        """
        known_ts = self._seen.get(batch.seq)
        return known_ts == batch.ts or (known_ts is None and in_replay)

    def _restart(self) -> Step:
        self.counters.num_restarts += 1
        step = Step()
        self._reset(step)
        return step

    def _restart_with(self, replay: _Replay) -> Step:
        """A replay revealed a restart: clear, then apply what it skipped as already applied
        (every replayed batch comes from the engine as it is now)."""
        step = self._restart()
        for skipped in replay.skipped:
            self._apply(skipped, step)
        replay.skipped.clear()
        return step

    def _reset(self, step: Step) -> None:
        step.clear = True
        step.batches.clear()
        self.last_seq = -1
        self._seen.clear()

    def _apply(self, batch: EventBatch, step: Step) -> None:
        self._remember(batch)
        step.batches.append(batch)

    def _remember(self, batch: Numbered) -> None:
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
        """Whether a replay from 0 that came back shows the engine's counter went back.

        A running engine replays up to its newest batch, at least ``last_seq``. A whole
        history (from seq 0) that ends below it, or no history at all, means a restart
        (while the indexer was down, or a restarted replica that has published nothing
        yet). Only a history from seq 0 is trusted that way: a replay may lose its tail
        (vLLM < 0.33, the ROUTER's send limit), and then this clear costs a rebuild, never
        blocks. An empty one cannot be a lost tail: the first message into a fresh DEALER's
        pipe is never dropped, so an engine with any batch buffered sends at least one.
        """
        if replay.start != 0 or self.last_seq < 0:
            return False
        if replay.num_received == 0:
            return complete
        return replay.first_seq == 0 and replay.max_seq < self.last_seq

    def _drain(self, replay: _Replay, *, failed: bool) -> Step:
        """Apply the batches buffered during a replay, in order.

        A new gap or restart starts another replay (a gap only past where this one started,
        so an empty reply cannot loop) and the remaining batches wait for it.
        """
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
        """Whether the batch that revealed a restart is covered by the replay it started.

        A replay that came back holds every batch the engine had published, so if the
        batch is not among them it was stale. Judging it again could restart forever.
        """
        revealing = replay.pending[0]
        return revealing.seq <= self.last_seq or (not failed and replay.num_received > 0)


def _then(step: Step, later: Step) -> None:
    """Fold ``later`` into ``step`` (a clear discards what ``step`` would have applied)."""
    if later.clear:
        step.clear = True
        step.batches.clear()
    step.history_lost = step.history_lost or later.history_lost
    step.batches.extend(later.batches)
    if later.replay_from is not None:
        step.replay_from = later.replay_from
