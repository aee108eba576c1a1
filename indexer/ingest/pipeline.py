"""The socket-free core of the write path: frames in, index and stream records updated. A
:class:`Pipeline` decodes, orders (a :class:`~kvindex.indexer.ingest.stream.StreamTracker` per
stream) and applies live frames and replay replies, reports each stream once a call, and decides
replays, restarts, purges and resyncs; its caller owns the sockets and :class:`ReplayRequests`.
Bad frames and events are counted, never fatal. One thread calls it; pipelines may share one
(thread-safe) index and registry, each keeping its own streams."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.domain.errors import SettingsError
from kvindex.indexer.domain.events import EventBatch, StreamId, Topic
from kvindex.indexer.domain.health import COMPLETE, Partial, StreamReport, UnroutedCounters
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.protocol import (
    BlockIndex,
    FencedError,
    IndexUnavailableError,
    StoreIdentity,
    drop_replica,
)
from kvindex.indexer.ingest.ingestor import AnyBatch, Ingestor
from kvindex.indexer.ingest.stream import Step, StreamTracker
from kvindex.indexer.ingest.wire import ReplayReply, WireError, decode_live, decode_live_native
from kvindex.indexer.redis.schema import SchemaError, check_name

log = logging.getLogger("kvindex.subscriber")  # the write path's one logger name

_UNKNOWN_TS = -1.0


class ReplayRequests(Protocol):
    """Replays the pipeline asks its socket owner for (at most one open per stream)."""

    def start_replay(self, stream: StreamId, endpoint: str, start_seq: int) -> None:
        """Ask ``endpoint`` for every batch from ``start_seq`` on (answered to ``on_replay``)."""
        ...

    def end_replay(self, stream: StreamId) -> int:
        """Close the stream's replay; returns how many of its replies were undecodable."""
        ...


MAX_TOPIC_ID_CHARS = 128
MAX_TOPIC_MODEL_CHARS = 256
MAX_TOPIC_RANKS = 1024


@dataclass(slots=True)
class _Runtime:
    stream: StreamId
    model: str
    tracker: StreamTracker
    replay_endpoint: str | None
    report: StreamReport
    replay_open: bool = False
    last_rebuild: float = float("-inf")
    broken: bool = False
    purged: bool = False
    disconnected: bool = False
    heard_at: float = float("-inf")
    pending: list[AnyBatch] = field(default_factory=list)
    queued: bool = False
    logged: set[str] = field(default_factory=set)
    fenced: bool = False
    clear_done: float = float("-inf")
    """When the last ask to drop its blocks that was carried out was made."""


class Pipeline:
    """Keeps the index and the registry's stream records in step with the replicas' frames.

    Without ``replays`` no stream replays. ``claim`` fences a stream's previous owner out
    before its watermark is read (sharded); a write refused by the fence is counted and the
    stream handed to the caller (:meth:`take_fenced`). ``native_ingest``: a known stream's
    next batch of common events takes the compiled path when the index offers it."""

    def __init__(
        self,
        settings: IndexerSettings,
        index: BlockIndex,
        registry: Registry,
        *,
        replays: ReplayRequests | None = None,
        clock: Callable[[], float] = time.monotonic,
        claim: Callable[[StreamId], None] | None = None,
        native_ingest: bool = True,
        publish_unrouted: Callable[[UnroutedCounters], None] | None = None,
    ) -> None:
        self._settings = settings
        self._claim = claim
        self._fenced: list[StreamId] = []
        self.num_fenced_batches = 0
        self._index = index
        self._registry = registry
        self._replays = replays
        self._clock = clock
        self._ingestor = Ingestor(index, cache_size=settings.key_cache_entries)
        self._native = native_ingest and self._ingestor.native
        self._runtimes: dict[StreamId, _Runtime] = {}
        self._known_version = -1
        self.counters = UnroutedCounters()
        self._num_self_registered = 0
        self._published = UnroutedCounters()
        self._publish_unrouted = publish_unrouted or registry.record_unrouted
        self._identity = index if isinstance(index, StoreIdentity) else None
        self._check_store()  # adopts the store as it is now: a later loss is told apart

    # --- the fleet -----------------------------------------------------------------------

    def reconcile(self) -> list[ReplicaSpec] | None:
        """None if the registry's replicas are unchanged; else forget removed replicas'
        streams (their blocks purged) and return every replica now registered."""
        version = self._registry.version
        if version == self._known_version:
            return None
        self._known_version = version
        wanted = self._registry.replicas()
        for replica in {s.replica for s in self._runtimes} - {r.id for r in wanted}:
            self._forget_replica(replica)
        return wanted

    def track(self, stream: StreamId, spec: ReplicaSpec) -> None:
        self._runtime(stream, spec)

    def release(self, stream: StreamId) -> None:
        runtime = self._runtimes.pop(stream, None)
        if runtime is None:
            return
        self._end_replay(runtime)
        self._ingestor.forget(stream)
        self._registry.forget(stream)

    def release_all(self) -> None:
        """Forget every stream (this process's lease ran out: nothing it kept is trusted)."""
        for stream in list(self._runtimes):
            self.release(stream)
        self._fenced = []

    def claimed(self) -> list[StreamId]:
        """The streams this pipeline writes: claimed, not handed over."""
        return [stream for stream, runtime in self._runtimes.items() if not runtime.fenced]

    def hand_over(self, stream: StreamId) -> None:
        """Another indexer claimed ``stream`` (seen without a refused batch): as if fenced."""
        if (runtime := self._runtimes.get(stream)) is not None:
            self._fenced_out(runtime, 0)

    def take_fenced(self) -> list[StreamId]:
        fenced, self._fenced = self._fenced, []
        return fenced

    def restart(self) -> None:
        """After the calling thread died mid-call: every stream resyncs from the index at
        the next :meth:`maintain`; open replays are closed, nothing pending is applied."""
        for runtime in self._runtimes.values():
            self._end_replay(runtime)
            runtime.pending = []
            runtime.queued = False
            if not runtime.fenced:
                runtime.broken = True

    def close(self) -> None:
        for runtime in self._runtimes.values():
            if runtime.replay_open:
                self._end_replay(runtime)
                self._record(runtime)

    # --- live frames ---------------------------------------------------------------------

    def handle_live(self, frames: list[bytes], stream: StreamId | None) -> None:
        self.handle_frames([frames], stream)

    def handle_frames(self, messages: list[list[bytes]], stream: StreamId | None) -> None:
        """Live messages drained from one socket (``stream`` None: the bound SUB's, named by
        topic); each stream's in-order batches go to the index in one call, and each stream
        touched is reported once."""
        touched: list[_Runtime] = []
        native = self._native and stream is not None
        runtime: _Runtime | None = None
        for frames in messages:
            if native:
                runtime = runtime or self._runtimes.get(stream)  # type: ignore[arg-type]
                if self._took_native(runtime, frames):
                    if not runtime.queued:  # type: ignore[union-attr]  # took it: not None
                        runtime.queued = True  # type: ignore[union-attr]
                        touched.append(runtime)  # type: ignore[arg-type]
                    continue
            try:
                message = decode_live(frames)
            except WireError as exc:
                runtime = self._bad_frame(stream, exc)
            else:
                runtime = self._on_batch(stream, message.topic, message.batch)
            if runtime is not None and not runtime.queued:
                runtime.queued = True
                touched.append(runtime)
        now = self._clock() if touched else 0.0
        for runtime in touched:
            runtime.queued = False
            runtime.heard_at = now
            self._flush(runtime)
            self._record(runtime)
        if self.counters != self._published:
            self._published = replace(self.counters)
            self._publish_unrouted(self._published)

    def _took_native(self, runtime: _Runtime | None, frames: list[bytes]) -> bool:
        """True if the message was the stream's next batch, now pending as a ``NativeBatch``;
        False: nothing was done."""
        if runtime is None or runtime.broken or runtime.fenced:
            return False
        batch = decode_live_native(frames)
        if batch is None or not runtime.tracker.accept_next(batch):
            return False
        runtime.pending.append(batch)
        return True

    def _on_batch(self, stream: StreamId | None, topic: str, batch: EventBatch) -> _Runtime | None:
        runtime = self._runtime_for(stream, topic, batch)
        if runtime is None or runtime.broken or runtime.fenced:
            return None
        if runtime.tracker.accept_next(batch):
            runtime.pending.append(batch)
            return runtime
        self._flush(runtime)  # before the step: a clear among them precedes a reset it makes
        step = runtime.tracker.on_live(batch)
        if step.clear or step.replay_from is not None:
            self._execute(runtime, step, live=True)
        else:
            runtime.pending.extend(step.batches)
        return runtime

    def _bad_frame(self, stream: StreamId | None, exc: WireError) -> _Runtime | None:
        runtime = None if stream is None else self._runtimes.get(stream)
        if runtime is None:
            self.counters.num_undecodable += 1
            if self.counters.num_undecodable == 1:
                log.warning("undecodable frame on the bound SUB (further ones counted): %s", exc)
            return None
        runtime.report.num_decode_errors += 1
        self._log_once(runtime, "decode", "undecodable frame (further ones counted): %s", exc)
        if exc.seq is not None:
            # Only the payload was bad: move past this seq rather than replay it forever.
            skipped = EventBatch(exc.seq, _UNKNOWN_TS, runtime.stream.rank, ())
            self._on_batch(runtime.stream, "", skipped)
            self._flush(runtime)
        return runtime

    # --- streams -------------------------------------------------------------------------

    def _runtime_for(
        self, stream: StreamId | None, topic: str, batch: EventBatch
    ) -> _Runtime | None:
        if stream is None:
            return self._register_from_topic(topic, batch.rank)
        runtime = self._runtimes.get(stream)
        if runtime is None:
            spec = self._registry.get(stream.replica)
            if spec is None:
                self.counters.num_unidentified += 1
                return None
            runtime = self._runtime(stream, spec)
        return runtime

    def _register_from_topic(self, topic: str, rank: int) -> _Runtime | None:
        """Bind mode: the topic names the stream; an unknown replica is registered from it
        within the limits, else the batch is counted as refused."""
        parsed = Topic.parse(topic)
        replica = parsed.replica or topic
        stream = StreamId(replica, rank)
        runtime = self._runtimes.get(stream)
        if runtime is not None:
            return runtime
        spec = self._registry.get(replica)
        if spec is None:
            spec = self._spec_from_topic(topic, replica, parsed.model)
        if spec is None or not self._rank_in_range(spec, rank, topic):
            return None
        if self._registry.add(spec):
            self._num_self_registered += 1
            self._known_version = self._registry.version  # nothing to open for it
        log.info("replica %s rank %d registered from its topic %r", replica, rank, topic[:200])
        return self._runtime(stream, spec)

    def _spec_from_topic(self, topic: str, replica: str, model: str | None) -> ReplicaSpec | None:
        model = model or self._settings.default_model
        if not replica or model is None:
            self._unrouted("unidentified", "event with topic %r names no replica", topic)
            return None
        if (
            len(replica) > MAX_TOPIC_ID_CHARS
            or len(model) > MAX_TOPIC_MODEL_CHARS
            or self._num_self_registered >= self._settings.max_self_registered
        ):
            self._unrouted("refused", "topic %r refused: past a registration limit", topic)
            return None
        try:
            check_name("replica id", replica)
            return ReplicaSpec(id=replica, model=model)
        except (SchemaError, SettingsError):
            self._unrouted("refused", "topic %r refused: not a valid replica id", topic)
            return None

    def _rank_in_range(self, spec: ReplicaSpec, rank: int, topic: str) -> bool:
        limit = spec.dp_size if spec.dp_size > 1 else MAX_TOPIC_RANKS
        if 0 <= rank < limit:
            return True
        self._unrouted("refused", "topic %r refused: rank out of range", topic)
        return False

    def _unrouted(self, kind: str, message: str, topic: str) -> None:
        if kind == "refused":
            self.counters.num_refused += 1
            first = self.counters.num_refused == 1
        else:
            self.counters.num_unidentified += 1
            first = self.counters.num_unidentified == 1
        if first:
            log.warning(message + " (further ones counted)", topic[:200])

    def _runtime(self, stream: StreamId, spec: ReplicaSpec) -> _Runtime:
        runtime = self._runtimes.get(stream)
        if runtime is not None:
            return runtime
        replay = None if self._replays is None else spec.replay_for_rank(stream.rank)
        can_replay = replay is not None
        report = StreamReport()
        refused = False
        try:
            if self._claim is not None:
                self._claim(stream)  # fence out the previous owner before reading its mark
            tracker = self._tracker_from_index(stream, can_replay=can_replay, report=report)
        except IndexUnavailableError:  # the first store call will fail too, and be counted
            tracker = StreamTracker(can_replay=can_replay, counters=report)
        except FencedError:  # this process's lease ran out: no record, handed straight back
            tracker = StreamTracker(can_replay=can_replay, counters=report)
            refused = True
        runtime = _Runtime(stream, spec.model, tracker, replay, report, heard_at=self._clock())
        self._runtimes[stream] = runtime
        if refused:
            self._fenced_out(runtime, 0)
            return runtime
        if tracker.last_seq >= 0:  # the index kept the stream: and its view's state
            tracker.partial = self._registry.resume_partial(stream)
        self._registry.record(stream, report)  # an empty report: the record exists now
        return runtime

    def _tracker_from_index(
        self, stream: StreamId, *, can_replay: bool, report: StreamReport
    ) -> StreamTracker:
        stats = self._index.stats(stream)
        return StreamTracker(
            can_replay=can_replay,
            watermark=stats.watermark,
            last_ts=stats.last_event_ts,
            counters=report,
        )

    def _forget_replica(self, replica: str) -> None:
        for stream in [s for s in self._runtimes if s.replica == replica]:
            self._end_replay(self._runtimes.pop(stream))
            self._ingestor.forget(stream)
        try:
            dropped = drop_replica(self._index, replica)
        except IndexUnavailableError as exc:
            log.warning("replica %s removed but its blocks could not be purged: %s", replica, exc)
            return
        log.info("replica %s removed; purged %d stream(s)", replica, len(dropped))

    def _record(self, runtime: _Runtime) -> None:
        report = runtime.report
        report.replaying = runtime.tracker.replaying
        report.partial = runtime.tracker.partial or COMPLETE
        runtime.report = runtime.tracker.counters = StreamReport()
        self._registry.record(runtime.stream, report)

    # --- carrying out steps --------------------------------------------------------------

    def _execute(self, runtime: _Runtime, step: Step, *, live: bool = False) -> None:
        stream = runtime.stream
        if step.clear:
            try:
                self._index.clear(stream)
            except IndexUnavailableError as exc:
                self._store_failed(runtime, exc)
                return
            except FencedError:
                self._fenced_out(runtime, 1)
                return
            self._ingestor.forget(stream)
            log.info("stream %s cleared (engine restart, rebuild or lost history)", stream)
        if step.history_lost:
            self._history_lost(runtime)
        runtime.pending.extend(step.batches)
        self._flush(runtime, live=live)
        if not runtime.broken and step.replay_from is not None:
            self._start_replay(runtime, step.replay_from)

    def _history_lost(self, runtime: _Runtime) -> None:
        """History no replay could give back was cleared: start the rebuild cooldown now, as
        orphans that follow cannot be rebuilt either."""
        runtime.last_rebuild = self._clock()
        self._log_once(
            runtime,
            "history",
            "stream %s: history lost (a gap no replay could fill); its blocks were dropped "
            "and it is rebuilt from the batches that follow (further ones counted)",
            runtime.stream,
        )

    def _flush(self, runtime: _Runtime, *, live: bool = True) -> None:
        batches = runtime.pending
        if not batches:
            return
        runtime.pending = []
        if runtime.broken or runtime.fenced:
            return
        report = runtime.report
        num_orphans, num_clears = report.num_orphan_stores, report.num_clears
        try:
            self._ingestor.apply_many(runtime.stream, runtime.model, batches, report)
        except IndexUnavailableError as exc:
            self._store_failed(runtime, exc)
            return
        except FencedError:
            self._fenced_out(runtime, len(batches))
            return
        if report.num_clears > num_clears:
            runtime.tracker.on_cleared()
        last = batches[-1]
        report.last_seq = last.seq
        report.last_event_ts = last.ts
        report.last_replayed = not live
        if (
            report.num_orphan_stores
            or report.num_unknown_removals
            or report.num_misaligned_events
            or report.num_bad_events
        ):
            self._log_problems(runtime, report)
        if report.num_orphan_stores > num_orphans and not runtime.tracker.replaying:
            self._maybe_rebuild(runtime)

    def _log_problems(self, runtime: _Runtime, report: StreamReport) -> None:
        self._log_once(
            runtime,
            "report",
            "stream %s: %d orphan stores, %d unknown removals, %d misaligned and %d bad "
            "events (further ones counted)",
            runtime.stream,
            report.num_orphan_stores,
            report.num_unknown_removals,
            report.num_misaligned_events,
            report.num_bad_events,
        )

    def _maybe_rebuild(self, runtime: _Runtime) -> None:
        now = self._clock()
        if now - runtime.last_rebuild < self._settings.rebuild_cooldown_s:
            return
        if runtime.tracker.partial == Partial.OVER_PREDICTED:
            return  # its history was found lying: a replay would give the blocks back
        runtime.last_rebuild = now
        step = runtime.tracker.resync(rebuild=True)
        if step.replay_from is not None:
            log.info("stream %s: orphaned stores, rebuilding by replay", runtime.stream)
            self._start_replay(runtime, step.replay_from)

    def _store_failed(self, runtime: _Runtime, exc: IndexUnavailableError) -> None:
        runtime.broken = True
        self._end_replay(runtime)
        runtime.report.num_store_errors += 1
        log.warning("stream %s: index store unavailable, will resync: %s", runtime.stream, exc)

    def _fenced_out(self, runtime: _Runtime, num_batches: int) -> None:
        self.num_fenced_batches += num_batches
        if runtime.fenced:
            return
        runtime.fenced = True
        self._end_replay(runtime)
        self._fenced.append(runtime.stream)
        log.info(
            "stream %s: owned by another indexer now (%d batch(es) fenced out): handed over",
            runtime.stream,
            num_batches,
        )

    def _log_once(self, runtime: _Runtime, kind: str, message: str, *args: object) -> None:
        if kind not in runtime.logged:
            runtime.logged.add(kind)
            log.warning(message, *args)

    # --- replay --------------------------------------------------------------------------

    def on_replay(self, stream: StreamId, replies: Sequence[ReplayReply]) -> None:
        runtime = self._runtimes.get(stream)
        if runtime is None or not runtime.replay_open:
            return
        for reply in replies:
            if reply.batch is None:
                num_undecodable = self._end_replay(runtime)
                step = runtime.tracker.on_replay_end(complete=num_undecodable == 0)
                self._execute(runtime, step)
                break
            self._execute(runtime, runtime.tracker.on_replay(reply.batch))
            if runtime.broken:
                break
        self._record(runtime)

    def replay_timed_out(self, stream: StreamId) -> None:
        runtime = self._runtimes.get(stream)
        if runtime is None or not runtime.replay_open:
            return
        log.warning("stream %s: replay timed out", stream)
        self._end_replay(runtime)
        self._execute(runtime, runtime.tracker.on_replay_failed())
        self._record(runtime)

    def _start_replay(self, runtime: _Runtime, start_seq: int, *, probe: bool = False) -> None:
        if runtime.replay_endpoint is None or self._replays is None:
            return
        self._end_replay(runtime)
        self._replays.start_replay(runtime.stream, runtime.replay_endpoint, start_seq)
        runtime.replay_open = True
        # A probe of each silent stream every few seconds would flood the info log.
        log.log(
            logging.DEBUG if probe else logging.INFO,
            "stream %s: replay from seq %d%s",
            runtime.stream,
            start_seq,
            " (probe)" if probe else "",
        )

    def _end_replay(self, runtime: _Runtime) -> int:
        if not runtime.replay_open or self._replays is None:
            return 0
        runtime.replay_open = False
        num_undecodable = self._replays.end_replay(runtime.stream)
        runtime.report.num_decode_errors += num_undecodable
        return num_undecodable

    # --- connection ----------------------------------------------------------------------

    def on_connected(self, stream: StreamId) -> None:
        runtime = self._runtimes.get(stream)
        if runtime is None:
            return
        runtime.report.connected = True
        runtime.purged = runtime.disconnected = False
        runtime.heard_at = self._clock()
        log.info("stream %s: connected; resyncing", stream)
        self._execute(runtime, runtime.tracker.resync())
        self._record(runtime)

    def on_disconnected(self, stream: StreamId) -> None:
        runtime = self._runtimes.get(stream)
        if runtime is None:
            return
        runtime.report.connected = False
        runtime.disconnected = True
        log.warning("stream %s: disconnected", stream)
        self._record(runtime)

    # --- periodic ------------------------------------------------------------------------

    def maintain(self) -> None:
        """Refill after a store loss, resync streams whose store is back, probe silent
        streams, purge long-disconnected ones. About once a second."""
        self._check_store()
        now = self._clock()
        for runtime in list(self._runtimes.values()):
            if runtime.fenced:
                continue
            if runtime.broken:
                self._recover(runtime)
            self._maybe_probe(runtime, now)
            self._maybe_purge(runtime)
        self._clear_asked()

    def _check_store(self) -> None:
        if self._identity is None:
            return
        try:
            intact = self._identity.intact()
        except IndexUnavailableError:
            return  # a stream's next write counts it; the next call looks again
        if intact:
            return
        log.warning(
            "index store lost its data (restarted empty or flushed): refilling %d stream(s)",
            len(self._runtimes),
        )
        for runtime in list(self._runtimes.values()):
            if not runtime.fenced:
                self._refill(runtime)

    def _refill(self, runtime: _Runtime) -> None:
        """Rebuild one stream from nothing: a fresh tracker, the stream cleared (the index
        skips seqs at or below its watermark), then a replay from 0 or its next batch on."""
        self._end_replay(runtime)
        runtime.pending = []
        runtime.broken = False
        runtime.tracker = StreamTracker(
            can_replay=runtime.tracker.can_replay, counters=runtime.report
        )
        runtime.report.num_store_refills += 1
        self._ingestor.forget(runtime.stream)
        try:
            self._index.clear(runtime.stream)
        except IndexUnavailableError as exc:
            self._store_failed(runtime, exc)
        except FencedError:
            self._fenced_out(runtime, 1)
        else:
            if not runtime.disconnected:  # else its reconnect resyncs it
                self._execute(runtime, runtime.tracker.resync())
        self._record(runtime)

    def _maybe_probe(self, runtime: _Runtime, now: float) -> None:
        interval = self._settings.probe_interval_s
        if interval <= 0 or runtime.replay_endpoint is None or now - runtime.heard_at < interval:
            return
        if runtime.broken or runtime.replay_open or runtime.disconnected:
            return
        runtime.heard_at = now
        step = runtime.tracker.probe()
        if step.replay_from is not None:
            self._start_replay(runtime, step.replay_from, probe=True)
            self._record(runtime)

    def _recover(self, runtime: _Runtime) -> None:
        can_replay = runtime.tracker.can_replay
        try:
            tracker = self._tracker_from_index(
                runtime.stream, can_replay=can_replay, report=runtime.report
            )
        except IndexUnavailableError:
            return
        tracker.partial = runtime.tracker.partial  # the store kept what it had
        runtime.tracker = tracker
        runtime.broken = False
        self._ingestor.forget(runtime.stream)
        log.info("stream %s: index store reachable again; resyncing", runtime.stream)
        self._execute(runtime, tracker.resync())
        self._record(runtime)

    def _clear_asked(self) -> None:
        """Drop the blocks asked (``Registry.ask_clear``) once per ask; no replay (same blocks)."""
        asks = self._registry.clear_asks()
        if not asks:
            return
        for runtime in list(self._runtimes.values()):
            asked = asks.get(runtime.stream.replica)
            if asked is None or asked <= runtime.clear_done:
                continue
            if runtime.fenced or runtime.broken or runtime.replay_open:
                continue  # asked again at the next maintenance
            try:
                self._index.clear(runtime.stream)
            except IndexUnavailableError:
                continue
            except FencedError:
                self._fenced_out(runtime, 1)
                continue
            runtime.clear_done = asked
            runtime.tracker.lose_view(Partial.OVER_PREDICTED)
            self._ingestor.forget(runtime.stream)
            self._record(runtime)
            log.warning("stream %s: blocks dropped (over-predicted by the index)", runtime.stream)

    def _maybe_purge(self, runtime: _Runtime) -> None:
        limit = self._settings.purge_after_s
        if limit <= 0 or runtime.purged:
            return
        gone_for = self._registry.disconnected_for(runtime.stream)
        if gone_for is None or gone_for < limit:
            return
        try:
            self._index.clear(runtime.stream)
        except IndexUnavailableError:
            return
        except FencedError:
            self._fenced_out(runtime, 1)
            return
        runtime.purged = True
        runtime.tracker.lose_view(Partial.PURGED)
        self._record(runtime)
        self._ingestor.forget(runtime.stream)
        log.warning("stream %s: disconnected %.0fs, blocks purged", runtime.stream, gone_for)
