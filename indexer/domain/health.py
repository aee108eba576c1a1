"""One stream's health: :class:`StreamHealth`, the record everyone reads whole, and
:class:`StreamReport`, the delta the write path folds into it (``Registry.record``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeAlias


class Partial(enum.StrEnum):
    """Why a stream's view is partial (the replica may hold blocks of batches never applied);
    whole again from its engine's first batch (seq 0) or an ``AllBlocksCleared`` applied."""

    REPLAY_GAP_PAST_BUFFER = "replay_gap_past_buffer"
    """A gap reached further back than the replica's replay buffer."""
    GAP_UNREPAIRED = "gap_unrepaired"
    """A gap no replay repaired (no replay endpoint, or the replay failed)."""
    RESTART_PAST_BUFFER = "restart_past_buffer"
    """The engine restarted, and its first batches were gone before the index read them."""
    START_PAST_BUFFER = "start_past_buffer"
    """The index began the stream empty after the replica's buffer had moved past seq 0."""
    JOINED_WITHOUT_REPLAY = "joined_without_replay"
    """The index began the stream empty past seq 0, with no replay endpoint to ask."""
    PURGED = "purged_while_disconnected"
    """The stream's blocks were purged while it was disconnected; it came back unchanged."""
    OVER_PREDICTED = "cleared_on_over_predictions"
    """The proxy saw the index credit blocks the engine lacked, again and again: dropped."""


COMPLETE = ""
"""A report's ``partial`` when the stream's view is whole again."""


@dataclass(slots=True)
class StreamCounters:
    """Every counter of one stream: running totals in a record, a delta in a report."""

    num_batches: int = 0
    num_gaps: int = 0
    num_unrepaired_gaps: int = 0
    num_replays: int = 0
    num_replay_failures: int = 0
    num_replay_truncated: int = 0
    num_restarts: int = 0
    num_duplicates: int = 0
    num_rebuilds: int = 0
    num_probes: int = 0
    num_history_lost: int = 0
    num_store_refills: int = 0
    num_decode_errors: int = 0
    num_store_errors: int = 0
    num_orphan_stores: int = 0
    num_unknown_removals: int = 0
    num_misaligned_events: int = 0
    num_bad_events: int = 0

    @property
    def num_errors(self) -> int:
        return self.num_decode_errors + self.num_bad_events + self.num_store_errors

    def add(self, other: StreamCounters) -> None:
        self.num_batches += other.num_batches
        self.num_gaps += other.num_gaps
        self.num_unrepaired_gaps += other.num_unrepaired_gaps
        self.num_replays += other.num_replays
        self.num_replay_failures += other.num_replay_failures
        self.num_replay_truncated += other.num_replay_truncated
        self.num_restarts += other.num_restarts
        self.num_duplicates += other.num_duplicates
        self.num_rebuilds += other.num_rebuilds
        self.num_probes += other.num_probes
        self.num_history_lost += other.num_history_lost
        self.num_store_refills += other.num_store_refills
        self.num_decode_errors += other.num_decode_errors
        self.num_store_errors += other.num_store_errors
        self.num_orphan_stores += other.num_orphan_stores
        self.num_unknown_removals += other.num_unknown_removals
        self.num_misaligned_events += other.num_misaligned_events
        self.num_bad_events += other.num_bad_events


@dataclass(slots=True)
class UnroutedCounters:
    num_undecodable: int = 0
    num_unidentified: int = 0
    num_refused: int = 0


@dataclass(slots=True)
class StreamReport(StreamCounters):
    """What the write path learnt about one stream since it last told the registry: the
    counters are deltas, every other field, when set, replaces the record's. One writer."""

    applied: bool = False
    num_blocks_stored: int = 0
    num_blocks_removed: int = 0
    num_clears: int = 0
    num_skipped_group_events: int = 0
    num_unresolved_stores: int = 0
    block_size: int = 0
    last_seq: int | None = None
    last_event_ts: float = 0.0
    last_replayed: bool = False
    replaying: bool | None = None
    connected: bool | None = None
    partial: str | None = None
    """A :class:`Partial` reason, or :data:`COMPLETE`."""


NativeCounts: TypeAlias = tuple[int, int, int, int, int, int, int, int, int, int]
"""Compiled ingest counts: batches applied, unknown removals, unresolved stores, blocks stored and
removed, clears, other-group, misaligned and orphan events, last block size (-1: none)."""


@dataclass(slots=True)
class StreamHealth(StreamCounters):
    """The one record of a stream's ingestion. Timestamps are wall-clock, so another process
    can judge a copy; not thread-safe: the registry changes it only through :meth:`update`."""

    connected: bool = False
    disconnected_at: float | None = None
    replaying: bool = False
    last_seq: int = -1
    last_event_ts: float | None = None
    lag_s: float | None = None
    last_heard: float | None = None
    block_size: int = 0
    partial: str | None = None
    """Why the index may lack blocks the replica holds (a :class:`Partial`); None: whole."""
    partial_since: float | None = None

    def update(self, report: StreamReport, now: float) -> None:
        self.add(report)
        if report.last_seq is not None:
            self.last_seq = report.last_seq
            self.last_event_ts = report.last_event_ts
            self.last_heard = now
            if not report.last_replayed:
                self.lag_s = max(0.0, now - report.last_event_ts)
        if report.block_size:
            self.block_size = report.block_size
        if report.replaying is not None:
            self.replaying = report.replaying
        if report.connected is not None:
            self.connected = report.connected
            self.disconnected_at = None if report.connected else now
        if report.partial is not None:
            self._set_partial(report.partial or None, now)

    def _set_partial(self, reason: str | None, now: float) -> None:
        """``since`` is when the view last went from whole to partial."""
        if reason is None:
            self.partial_since = None
        elif self.partial is None:
            self.partial_since = now
        self.partial = reason
