"""ZeroMQ side of the write path: sockets, topologies, reconnects, replays.

Two topologies, as vLLM allows (both may be used at once):

* **connect** — a replica's ``endpoint`` binds (``tcp://*:5557``, vLLM's default); the
  indexer connects one SUB per (replica, data-parallel rank), rank r at port + r. The
  stream is known from the socket; a socket monitor tells connects from disconnects.
* **bind** — the indexer binds one SUB (``settings.bind``); replicas connect to it (a vLLM
  endpoint without ``*``). Each stream is known from its topic ``kv@<replica>@<model>``
  and the batch's data-parallel rank, and is registered on its first event.

One thread runs :meth:`Subscriber.run`: it owns every socket, every
:class:`~kvindex.indexer.stream.StreamTracker` and the
:class:`~kvindex.indexer.ingest.Ingestor`, so each
stream's batches are applied in order. Nothing it receives can kill it: undecodable frames
and bad events are logged once per stream, counted and skipped; an unreachable index store
is counted and the stream resynced by replay once the store is back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvindex.indexer.errors import SettingsError
from kvindex.indexer.events import EventBatch, StreamId, Topic
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.health import StreamReport
from kvindex.indexer.index.protocol import BlockIndex, IndexUnavailableError, drop_replica
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.redis_schema import SchemaError, check_name
from kvindex.indexer.replay import ReplaySession
from kvindex.indexer.settings import IndexerSettings
from kvindex.indexer.stream import Step, StreamTracker
from kvindex.indexer.wire import WireError, decode_live

log = logging.getLogger("kvindex.subscriber")

_POLL_MS = 50
_MAX_MESSAGES_PER_WAKE = 1024
_MAINTENANCE_EVERY_S = 1.0
_UNKNOWN_TS = -1.0
"""Engine timestamp given to a batch whose payload could not be read."""


@dataclass(slots=True)
class _Runtime:
    """Everything the loop keeps for one stream."""

    stream: StreamId
    model: str
    tracker: StreamTracker
    replay_endpoint: str | None
    report: StreamReport
    """What to tell the registry next; the tracker counts into it too."""
    session: ReplaySession | None = None
    last_rebuild: float = float("-inf")
    broken: bool = False
    purged: bool = False
    pending: list[EventBatch] = field(default_factory=list)
    """In-order live batches not yet applied (flushed at the end of a socket drain)."""
    queued: bool = False
    logged: set[str] = field(default_factory=set)


@dataclass(slots=True)
class SubscriberCounters:
    """Counts that belong to no known stream (bind mode)."""

    num_undecodable: int = 0
    num_unidentified: int = 0


class Subscriber:
    """Subscribes to every replica and keeps the index in step with their caches."""

    def __init__(
        self,
        settings: IndexerSettings,
        index: BlockIndex,
        registry: Registry,
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._index = index
        self._registry = registry
        self._context = context or zmq.Context.instance()
        self._clock = clock
        self._ingestor = Ingestor(index, cache_size=settings.key_cache_size)
        self._poller = zmq.Poller()
        self._runtimes: dict[StreamId, _Runtime] = {}
        self._sub_of: dict[zmq.Socket[bytes], StreamId] = {}
        self._monitor_of: dict[zmq.Socket[bytes], StreamId] = {}
        self._sockets_of: dict[str, list[zmq.Socket[bytes]]] = {}
        self._session_of: dict[zmq.Socket[bytes], StreamId] = {}
        self._bound: zmq.Socket[bytes] | None = None
        self._known_version = -1
        self._next_maintenance = 0.0
        self.counters = SubscriberCounters()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.bound_endpoint: str | None = None

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Open sockets now (so bind errors surface here), then run in a daemon thread."""
        self._open_bound()
        self._reconcile()
        self._thread = threading.Thread(target=self._run, name="kvindex-subscriber", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._close_all()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception:  # the loop must survive anything; the data is counted
                log.exception("subscriber loop error (continuing)")
                time.sleep(0.1)

    def run_once(self, timeout_ms: int = _POLL_MS) -> None:
        """One loop turn: reconcile replicas, poll, handle, expire, maintain."""
        if self._registry.version != self._known_version:
            self._reconcile()
        for sock, _ in self._poller.poll(timeout_ms):
            self._dispatch(sock)
        self._expire_replays()
        now = self._clock()
        if now >= self._next_maintenance:
            self._next_maintenance = now + _MAINTENANCE_EVERY_S
            self._maintain()

    def _dispatch(self, sock: zmq.Socket[bytes]) -> None:
        if sock is self._bound:
            self._drain_sub(sock, None)
        elif sock in self._sub_of:
            self._drain_sub(sock, self._sub_of[sock])
        elif sock in self._monitor_of:
            self._on_monitor(sock, self._monitor_of[sock])
        elif sock in self._session_of:
            self._on_replay_readable(self._session_of[sock])

    # --- sockets -------------------------------------------------------------------------

    def _open_bound(self) -> None:
        if self._settings.bind is None or self._bound is not None:
            return
        sock = self._new_sub()
        sock.bind(self._settings.bind)
        self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._bound = sock
        self._poller.register(sock, zmq.POLLIN)
        log.info("bound SUB on %s", self.bound_endpoint)

    def _new_sub(self) -> zmq.Socket[bytes]:
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, int(self._settings.reconnect_min_s * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(self._settings.reconnect_max_s * 1000))
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        return sock

    def _reconcile(self) -> None:
        """Open sockets for new replicas; close and purge removed ones."""
        self._known_version = self._registry.version
        wanted = {r.id: r for r in self._registry.replicas()}
        for replica in [r for r in self._sockets_of if r not in wanted]:
            self._close_replica(replica)
        for replica in {s.replica for s in self._runtimes} - set(wanted):
            self._forget_replica(replica)
        for spec in wanted.values():
            if spec.events is not None and spec.id not in self._sockets_of:
                self._connect_replica(spec)

    def _connect_replica(self, spec: ReplicaSpec) -> None:
        sockets: list[zmq.Socket[bytes]] = []
        for rank in range(spec.dp_size):
            stream = StreamId(spec.id, rank)
            endpoint = spec.events_for_rank(rank)
            assert endpoint is not None
            sub = self._new_sub()
            monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sub.connect(endpoint)
            self._sub_of[sub] = stream
            self._monitor_of[monitor] = stream
            self._poller.register(sub, zmq.POLLIN)
            self._poller.register(monitor, zmq.POLLIN)
            sockets += [sub, monitor]
            self._runtime(stream, spec)
            log.info("replica %s rank %d: connecting to %s", spec.id, rank, endpoint)
        self._sockets_of[spec.id] = sockets

    def _close_replica(self, replica: str) -> None:
        for sock in self._sockets_of.pop(replica, []):
            self._poller.unregister(sock)
            if sock in self._sub_of:
                del self._sub_of[sock]
                sock.disable_monitor()
            self._monitor_of.pop(sock, None)
            sock.close(linger=0)
        self._forget_replica(replica)

    def _forget_replica(self, replica: str) -> None:
        """A removed replica: its sessions closed, its blocks purged from the index."""
        for stream in [s for s in self._runtimes if s.replica == replica]:
            self._end_session(self._runtimes.pop(stream))
            self._ingestor.forget(stream)
        try:
            dropped = drop_replica(self._index, replica)
        except IndexUnavailableError as exc:
            log.warning("replica %s removed but its blocks could not be purged: %s", replica, exc)
            return
        log.info("replica %s removed; purged %d stream(s)", replica, len(dropped))

    def _close_all(self) -> None:
        for replica in list(self._sockets_of):
            for sock in self._sockets_of.pop(replica):
                if sock in self._sub_of:
                    sock.disable_monitor()
                sock.close(linger=0)
        for runtime in self._runtimes.values():
            self._end_session(runtime)
        if self._bound is not None:
            self._bound.close(linger=0)
            self._bound = None

    # --- runtimes ------------------------------------------------------------------------

    def _runtime(self, stream: StreamId, spec: ReplicaSpec) -> _Runtime:
        runtime = self._runtimes.get(stream)
        if runtime is not None:
            return runtime
        replay = spec.replay_for_rank(stream.rank)
        report = StreamReport()
        tracker = self._new_tracker(stream, can_replay=replay is not None, report=report)
        runtime = _Runtime(stream, spec.model, tracker, replay, report)
        self._runtimes[stream] = runtime
        self._registry.record(stream, report)  # an empty report: the record exists from now
        return runtime

    def _new_tracker(
        self, stream: StreamId, *, can_replay: bool, report: StreamReport
    ) -> StreamTracker:
        """A tracker that starts from what the index already holds (indexer restart)."""
        try:
            stats = self._index.stats(stream)
        except IndexUnavailableError:
            return StreamTracker(can_replay=can_replay, counters=report)
        return StreamTracker(
            can_replay=can_replay,
            watermark=stats.watermark,
            last_ts=stats.last_event_ts,
            counters=report,
        )

    def _record(self, runtime: _Runtime) -> None:
        """Hand the stream's report to the registry; the tracker counts into a fresh one."""
        report = runtime.report
        report.replaying = runtime.tracker.replaying
        runtime.report = runtime.tracker.counters = StreamReport()
        self._registry.record(runtime.stream, report)

    # --- live messages -------------------------------------------------------------------

    def _drain_sub(self, sock: zmq.Socket[bytes], stream: StreamId | None) -> None:
        messages: list[list[bytes]] = []
        for _ in range(_MAX_MESSAGES_PER_WAKE):
            try:
                messages.append(sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        self.handle_frames(messages, stream)

    def handle_live(self, frames: list[bytes], stream: StreamId | None) -> None:
        """One live message from a known stream (connect mode) or the bound SUB (None)."""
        self.handle_frames([frames], stream)

    def handle_frames(self, messages: list[list[bytes]], stream: StreamId | None) -> None:
        """Live messages in arrival order, as drained from one socket.

        In-order batches of a stream are applied together (one index round trip); anything
        else (a gap, a restart) first flushes what is pending, then is carried out. Each
        stream touched is reported to the registry once, at the end.
        """
        touched: list[_Runtime] = []
        for frames in messages:
            try:
                message = decode_live(frames)
            except WireError as exc:
                runtime = self._bad_frame(stream, exc)
            else:
                runtime = self._on_batch(stream, message.topic, message.batch)
            if runtime is not None and not runtime.queued:
                runtime.queued = True
                touched.append(runtime)
        for runtime in touched:
            runtime.queued = False
            self._flush(runtime)
            self._record(runtime)

    def _on_batch(self, stream: StreamId | None, topic: str, batch: EventBatch) -> _Runtime | None:
        runtime = self._runtime_for(stream, topic, batch)
        if runtime is None or runtime.broken:
            return None
        if runtime.tracker.accept_next(batch):
            runtime.pending.append(batch)
            return runtime
        step = runtime.tracker.on_live(batch)
        if step.clear or step.replay_from is not None:
            self._flush(runtime)
            self._execute(runtime, step)
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
        """Bind mode: the topic ``kv@<replica>@<model>`` names the stream."""
        parsed = Topic.parse(topic)
        replica = parsed.replica or topic
        stream = StreamId(replica, rank)
        runtime = self._runtimes.get(stream)
        if runtime is not None:
            return runtime
        spec = self._registry.get(replica) or self._spec_from_topic(replica, parsed.model)
        if spec is None:
            self.counters.num_unidentified += 1
            if self.counters.num_unidentified == 1:
                log.warning("event with topic %r names no replica (further ones counted)", topic)
            return None
        if self._registry.add(spec):
            self._known_version = self._registry.version  # nothing to open for it
        log.info("replica %s rank %d registered from its topic %r", replica, rank, topic)
        return self._runtime(stream, spec)

    def _spec_from_topic(self, replica: str, model: str | None) -> ReplicaSpec | None:
        model = model or self._settings.default_model
        if not replica or model is None:
            return None
        try:
            check_name("replica id", replica)
            return ReplicaSpec(id=replica, model=model)
        except (SchemaError, SettingsError):
            return None

    # --- carrying out steps --------------------------------------------------------------

    def _execute(self, runtime: _Runtime, step: Step) -> None:
        stream = runtime.stream
        if step.clear:
            try:
                self._index.clear(stream)
            except IndexUnavailableError as exc:
                self._store_failed(runtime, exc)
                return
            self._ingestor.forget(stream)
            log.info("stream %s cleared (engine restart or rebuild)", stream)
        runtime.pending.extend(step.batches)
        self._flush(runtime)
        if not runtime.broken and step.replay_from is not None:
            self._start_replay(runtime, step.replay_from)

    def _flush(self, runtime: _Runtime) -> None:
        """Apply the stream's pending batches in one index call."""
        batches = runtime.pending
        if not batches:
            return
        runtime.pending = []
        if runtime.broken:
            return
        report = runtime.report
        num_orphans = report.num_orphan_stores
        try:
            self._ingestor.apply_many(runtime.stream, runtime.model, batches, report)
        except IndexUnavailableError as exc:
            self._store_failed(runtime, exc)
            return
        last = batches[-1]
        report.last_seq = last.seq
        report.last_event_ts = last.ts
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
        """Orphaned stores: rebuild from the engine's replay buffer, at most once a while."""
        now = self._clock()
        if now - runtime.last_rebuild < self._settings.rebuild_cooldown_s:
            return
        runtime.last_rebuild = now
        step = runtime.tracker.resync(rebuild=True)
        if step.replay_from is not None:
            log.info("stream %s: orphaned stores, rebuilding by replay", runtime.stream)
            self._start_replay(runtime, step.replay_from)

    def _store_failed(self, runtime: _Runtime, exc: IndexUnavailableError) -> None:
        runtime.broken = True
        self._end_session(runtime)
        runtime.report.num_store_errors += 1
        log.warning("stream %s: index store unavailable, will resync: %s", runtime.stream, exc)

    def _log_once(self, runtime: _Runtime, kind: str, message: str, *args: object) -> None:
        if kind not in runtime.logged:
            runtime.logged.add(kind)
            log.warning(message, *args)

    # --- replay --------------------------------------------------------------------------

    def _start_replay(self, runtime: _Runtime, start_seq: int) -> None:
        if runtime.replay_endpoint is None:
            return
        self._end_session(runtime)
        session = ReplaySession(
            self._context,
            runtime.replay_endpoint,
            start_seq,
            idle_timeout_s=self._settings.replay_timeout_s,
            clock=self._clock,
        )
        runtime.session = session
        self._session_of[session.socket] = runtime.stream
        self._poller.register(session.socket, zmq.POLLIN)
        log.info("stream %s: replay from seq %d", runtime.stream, start_seq)

    def _end_session(self, runtime: _Runtime) -> None:
        session = runtime.session
        if session is None:
            return
        runtime.session = None
        self._poller.unregister(session.socket)
        self._session_of.pop(session.socket, None)
        runtime.report.num_decode_errors += session.num_bad_frames
        session.close()

    def _on_replay_readable(self, stream: StreamId) -> None:
        runtime = self._runtimes.get(stream)
        if runtime is None or runtime.session is None:
            return
        for reply in runtime.session.receive():
            if reply.batch is None:
                self._end_session(runtime)
                self._execute(runtime, runtime.tracker.on_replay_end())
                break
            self._execute(runtime, runtime.tracker.on_replay(reply.batch))
            if runtime.broken:
                break
        self._record(runtime)

    def _expire_replays(self) -> None:
        for runtime in list(self._runtimes.values()):
            if runtime.session is not None and runtime.session.expired():
                log.warning("stream %s: replay timed out", runtime.stream)
                self._end_session(runtime)
                self._execute(runtime, runtime.tracker.on_replay_failed())
                self._record(runtime)

    # --- connection monitor --------------------------------------------------------------

    def _on_monitor(self, sock: zmq.Socket[bytes], stream: StreamId) -> None:
        while True:
            try:
                event = recv_monitor_message(sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            runtime = self._runtimes.get(stream)
            if runtime is None:
                continue
            if event["event"] == zmq.EVENT_CONNECTED:
                runtime.report.connected = True
                runtime.purged = False
                log.info("stream %s: connected; resyncing", stream)
                self._execute(runtime, runtime.tracker.resync())
                self._record(runtime)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                runtime.report.connected = False
                log.warning("stream %s: disconnected", stream)
                self._record(runtime)

    # --- periodic ------------------------------------------------------------------------

    def _maintain(self) -> None:
        for runtime in list(self._runtimes.values()):
            if runtime.broken:
                self._recover(runtime)
            self._maybe_purge(runtime)

    def _recover(self, runtime: _Runtime) -> None:
        """The store is back: restart the stream's tracker from the index and resync."""
        try:
            tracker = self._new_tracker_strict(runtime)
        except IndexUnavailableError:
            return
        runtime.tracker = tracker
        runtime.broken = False
        self._ingestor.forget(runtime.stream)
        log.info("stream %s: index store reachable again; resyncing", runtime.stream)
        self._execute(runtime, tracker.resync())
        self._record(runtime)

    def _new_tracker_strict(self, runtime: _Runtime) -> StreamTracker:
        stats = self._index.stats(runtime.stream)
        old = runtime.tracker
        return StreamTracker(
            can_replay=old.can_replay,
            watermark=stats.watermark,
            last_ts=stats.last_event_ts,
            counters=runtime.report,
        )

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
        runtime.purged = True
        self._ingestor.forget(runtime.stream)
        log.warning("stream %s: disconnected %.0fs, blocks purged", runtime.stream, gone_for)
