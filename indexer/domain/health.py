"""One stream's health: the record everyone reads, and the report that updates it.

Everything counted about a stream is one :class:`StreamCounters`, whoever counts it: the
:class:`~kvindex.indexer.ingest.stream.StreamTracker` (batches, gaps, replays, restarts), the
:class:`~kvindex.indexer.ingest.ingestor.Ingestor` (orphans, unknown removals, bad events) and the
pipeline (undecodable frames, store failures). The write path gathers them, with the last
applied batch and the connection, in a :class:`StreamReport`; the registry folds each report
into the stream's one :class:`StreamHealth` record (``Registry.record``), which the API, the
metrics, the CLI and the Redis-shared fleet state read whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias


@dataclass(slots=True)
class StreamCounters:
    """Every counter of one stream: running totals in a record, a delta in a report."""

    num_batches: int = 0
    """Batches accepted in order (live or replayed)."""
    num_gaps: int = 0
    num_unrepaired_gaps: int = 0
    num_replays: int = 0
    num_replay_failures: int = 0
    num_replay_truncated: int = 0
    num_restarts: int = 0
    num_duplicates: int = 0
    num_rebuilds: int = 0
    num_probes: int = 0
    """Seq-reset probes of a silent stream (a replay from its last applied seq)."""
    num_history_lost: int = 0
    """Times the stream was cleared because a gap could not be repaired (no replay
    endpoint, a replay that failed or began later than asked): what it had credited was
    dropped and it was rebuilt from the batches that followed."""
    num_store_refills: int = 0
    """Times the stream was rebuilt because the index store had lost its data (a Redis
    restarted empty, a FLUSHALL)."""
    num_decode_errors: int = 0
    """Undecodable frames, live or replayed."""
    num_store_errors: int = 0
    """Index store failures while ingesting (the stream then resyncs)."""
    num_orphan_stores: int = 0
    num_unknown_removals: int = 0
    num_misaligned_events: int = 0
    num_bad_events: int = 0

    @property
    def num_errors(self) -> int:
        """What an operator reads as errors: bad frames, bad events, store failures."""
        return self.num_decode_errors + self.num_bad_events + self.num_store_errors

    def add(self, other: StreamCounters) -> None:
        """Add another set of counters (a report's, another stream's) to these."""
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
    """Frames of the bound SUB that reached no stream: running totals, kept by the pipeline
    and published whole to the registry (``Registry.record_unrouted``)."""

    num_undecodable: int = 0
    """Frames that could not be decoded (so name no stream)."""
    num_unidentified: int = 0
    """Batches whose topic names no replica, or of a stream nobody registered."""
    num_refused: int = 0
    """Batches whose topic would register a replica past a limit: an id or model name too
    long, a rank out of range, or more self-registered replicas than allowed."""


@dataclass(slots=True)
class StreamReport(StreamCounters):
    """What the write path learnt about one stream since it last told the registry.

    The counters are deltas; every other field, when set, replaces the record's. The
    fields below the counters describe what applying batches did, for the caller (the
    :class:`~kvindex.indexer.ingest.ingestor.Ingestor` returns them; the record keeps only the
    block size). Not thread-safe: one writer fills a report, then hands it over.
    """

    applied: bool = False
    """True if at least one batch was above the watermark."""
    num_blocks_stored: int = 0
    num_blocks_removed: int = 0
    num_clears: int = 0
    num_skipped_group_events: int = 0
    num_unresolved_stores: int = 0
    block_size: int = 0
    """Block size of the last store with tokens (0: none seen)."""
    last_seq: int | None = None
    """Seq of the last batch applied (None: none was)."""
    last_event_ts: float = 0.0
    """Engine timestamp of that batch."""
    last_replayed: bool = False
    """Whether that batch came from a replay: it moves ``last_seq`` and ``last_event_ts``
    but not the lag (a replayed batch's age is how long ago it was published)."""
    replaying: bool | None = None
    """Whether the stream is being replayed now (None: unchanged)."""
    connected: bool | None = None
    """Whether its socket is connected now (None: unchanged)."""


NativeCounts: TypeAlias = tuple[int, int, int, int, int, int, int, int, int, int]
"""A report's counts as the compiled ingest path returns them: batches applied, unknown
removals, unresolved stores, blocks stored, blocks removed, clears, events of another group,
misaligned events, orphan stores, the last store's block size (-1: none)."""


@dataclass(slots=True)
class StreamHealth(StreamCounters):
    """The one record of a stream's ingestion: its counters, where it is, its connection.

    Every timestamp is wall-clock (``time.time``), so another process can read a copy
    (``kvindex.indexer.fleet.sync``) and judge silence and staleness itself. Mutable, and
    not thread-safe by itself: the registry keeps one per stream under its lock, changes it
    only through :meth:`update` and hands out copies.
    """

    connected: bool = False
    disconnected_at: float | None = None
    replaying: bool = False
    last_seq: int = -1
    last_event_ts: float | None = None
    """Engine timestamp of the last applied batch."""
    lag_s: float | None = None
    """Receive time minus engine timestamp of the last applied *live* batch (a replayed
    batch's age is not lag: it was published long ago on purpose)."""
    last_heard: float | None = None
    """When the last batch was applied."""
    block_size: int = 0
    """Tokens per block in this stream's events (0 until a store with tokens is seen)."""

    def update(self, report: StreamReport, now: float) -> None:
        """Fold in a report received at ``now``: counters add, set fields replace."""
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
