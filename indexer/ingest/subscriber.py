"""ZeroMQ side of the write path: sockets, topologies, reconnects, ingest workers. Connect mode:
a SUB per (replica, rank), a monitor telling connects from disconnects; bind mode: one SUB on
``settings.bind``, streams named by topic and rank. Each worker thread owns its streams and
pipeline (a stream's batches apply in order); sharded, only the streams its process owns."""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.domain.health import UnroutedCounters
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.protocol import BlockIndex
from kvindex.indexer.ingest.partition import StreamPartition, UnroutedTotals
from kvindex.indexer.ingest.pipeline import Pipeline
from kvindex.indexer.ingest.poller import ReadablePoller
from kvindex.indexer.ingest.process_limits import (
    describe_limits,
    file_limit,
    files_needed,
    sized_context,
)
from kvindex.indexer.ingest.replay import ReplaySession

if TYPE_CHECKING:  # sharding runs on Redis: a memory-store indexer loads no Redis client
    from kvindex.indexer.ingest.membership import Shard

log = logging.getLogger("kvindex.subscriber")

_POLL_MS = 50
_MAX_MESSAGES_PER_WAKE = 1024
_MAINTENANCE_EVERY_S = 1.0
_SUPERVISE_S = 0.5
_RECEIVE_HWM = 8

Context = zmq.Context[zmq.Socket[bytes]]
Socket = zmq.Socket[bytes]
_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)


class SocketLimitError(KvIndexError):
    """A socket could not open: the process reached its open-file or ZeroMQ socket limit."""


def _out_of_files(exc: zmq.ZMQError) -> bool:
    return exc.errno in _OUT_OF_FILES


class _ReplaySockets:
    """The pipeline's ``ReplayRequests``: one DEALER per open replay, polled by the loop; one
    that cannot open (out of files) is given up as a timed-out one. One thread."""

    def __init__(
        self,
        context: Callable[[], Context],
        poller: ReadablePoller,
        timeout_s: float,
        clock: Callable[[], float],
    ) -> None:
        self._context = context
        self._poller = poller
        self._timeout_s = timeout_s
        self._clock = clock
        self.sessions: dict[StreamId, ReplaySession] = {}
        self.stream_of: dict[Socket, StreamId] = {}
        self.unopened: set[StreamId] = set()
        self._limit_logged = False

    def start_replay(self, stream: StreamId, endpoint: str, start_seq: int) -> None:
        try:
            session = ReplaySession(
                self._context(),
                endpoint,
                start_seq,
                idle_timeout_s=self._timeout_s,
                clock=self._clock,
            )
        except zmq.ZMQError as exc:
            if not _out_of_files(exc):
                raise
            self._on_unopened(stream, exc)
            return
        self._limit_logged = False
        self.sessions[stream] = session
        self.stream_of[session.socket] = stream
        self._poller.register(session.socket)

    def _on_unopened(self, stream: StreamId, exc: zmq.ZMQError) -> None:
        self.unopened.add(stream)
        if not self._limit_logged:  # once until a replay opens again: not once per stream
            self._limit_logged = True
            log.error(
                "stream %s: cannot open a replay socket (%s): %s",
                stream,
                exc.strerror,
                describe_limits(self._context()),
            )

    def expired(self) -> list[StreamId]:
        late = [s for s, session in self.sessions.items() if session.expired()]
        return late + sorted(self.unopened)

    def end_replay(self, stream: StreamId) -> int:
        self.unopened.discard(stream)
        session = self.sessions.pop(stream, None)
        if session is None:
            return 0
        self._poller.unregister(session.socket)
        del self.stream_of[session.socket]
        session.close()
        return session.num_bad_frames


class SubscriberLoop:
    """One ingest worker's loop: its share of the streams' sockets (and the bound SUB if it
    is the first), fed to its own :class:`Pipeline`. One thread at a time."""

    def __init__(
        self,
        settings: IndexerSettings,
        index: BlockIndex,
        registry: Registry,
        *,
        context: Callable[[], Context],
        stop: threading.Event,
        clock: Callable[[], float] = time.monotonic,
        shard: Shard | None = None,
        worker: int = 0,
        partition: StreamPartition | None = None,
        publish_unrouted: Callable[[UnroutedCounters], None] | None = None,
    ) -> None:
        self._settings = settings
        self._shard = shard
        self.worker = worker
        self._partition = partition
        self._ranks_of: dict[str, tuple[int, ...]] = {}
        self._excluded: dict[StreamId, float] = {}
        self._zmq_context = context
        self._clock = clock
        self._poller = ReadablePoller()
        self._replays = _ReplaySockets(context, self._poller, settings.replay_timeout_s, clock)
        claim = None if shard is None else shard.claim
        self.pipeline = Pipeline(
            settings,
            index,
            registry,
            replays=self._replays,
            clock=clock,
            claim=claim,
            publish_unrouted=publish_unrouted,
        )
        self._sub_of: dict[Socket, StreamId] = {}
        self._monitor_of: dict[Socket, StreamId] = {}
        self._sockets_of: dict[str, list[Socket]] = {}
        self._specs: list[ReplicaSpec] = []
        self._num_unopened = 0
        self._bound: Socket | None = None
        self._next_maintenance = 0.0
        self._stop = stop
        self.bound_endpoint: str | None = None

    # --- lifecycle -----------------------------------------------------------------------

    def open(self) -> None:
        """Open the bound SUB (first worker) and the owned streams' sockets; raises
        :class:`SocketLimitError` or :class:`zmq.ZMQError` (the caller closes)."""
        if self.worker == 0:
            self._open_bound()
        self._reconcile(strict=True)

    @property
    def subscribed_replicas(self) -> list[str]:
        return sorted(self._sockets_of)

    @property
    def num_streams_open(self) -> int:
        return len(self._sub_of)

    def run_once(self, timeout_ms: int = _POLL_MS) -> None:
        self._reconcile()
        if self._shard is not None:
            self._shard_turn()
        if not self._poller.sockets:
            self._stop.wait(timeout_ms / 1000)
        for sock in self._poller.poll(timeout_ms):
            self._dispatch(sock)
        for stream in self._replays.expired():
            self.pipeline.replay_timed_out(stream)
        now = self._clock()
        if now >= self._next_maintenance:
            self._next_maintenance = now + _MAINTENANCE_EVERY_S
            self.pipeline.maintain()
            if self._num_unopened:
                self._open_replicas(strict=False)

    # --- sharding ------------------------------------------------------------------------

    def _shard_turn(self) -> None:
        assert self._shard is not None
        renewed = self._shard.tick()
        if self._shard.take_rejoined():
            self._drop_every_stream()
        elif renewed:  # a claim taken since (its owner's view lagged a join): handed over too
            for stream in self._shard.lost_claims(self.pipeline.claimed()):
                self.pipeline.hand_over(stream)
        fenced = self.pipeline.take_fenced()
        hold_off = self._clock() + self._shard.membership.renew_period_s
        for stream in fenced:
            self._excluded[stream] = hold_off
            if stream.replica not in self._sockets_of:  # bind mode: no socket of its own
                self.pipeline.release(stream)
        if renewed or fenced:
            self._rebalance()

    def _drop_every_stream(self) -> None:
        """A new lease: close and forget every stream, so each owned one is claimed afresh
        (its mark read again from the index) and nothing of the old lease is published."""
        for replica in {*self._ranks_of, *self._sockets_of}:
            self._close_replica(replica)
        self._excluded.clear()
        self.pipeline.release_all()

    def _owned_ranks(self, spec: ReplicaSpec, every_worker: bool = False) -> tuple[int, ...]:
        """The replica's ranks this loop (``every_worker``: the process) takes; sharded, owned."""
        ranks: list[int] | range = range(spec.dp_size)
        if self._partition is not None and not every_worker:
            worker_of = self._partition.worker_of
            ranks = [r for r in ranks if worker_of(StreamId(spec.id, r)) == self.worker]
        if self._shard is None:
            return tuple(ranks)
        now = self._clock()
        return tuple(
            rank
            for rank in ranks
            if self._shard.owns(stream := StreamId(spec.id, rank))
            and self._excluded.get(stream, now) <= now
        )

    def _rebalance(self) -> None:
        now = self._clock()
        self._excluded = {s: t for s, t in self._excluded.items() if t > now}
        spec_of = {s.id: s for s in self._specs}
        for replica, ranks in list(self._ranks_of.items()):
            spec = spec_of.get(replica)
            owned = () if spec is None else self._owned_ranks(spec)
            if owned == ranks:
                continue
            self._close_replica(replica)
            for rank in set(ranks) - set(owned):
                self.pipeline.release(StreamId(replica, rank))
                log.info("replica %s rank %d: handed to another indexer", replica, rank)
        self._open_replicas(strict=False)

    def _dispatch(self, sock: Socket) -> None:
        if sock is self._bound:
            self._drain_sub(sock, None)
        elif sock in self._sub_of:
            self._drain_sub(sock, self._sub_of[sock])
        elif sock in self._monitor_of:
            self._on_monitor(sock, self._monitor_of[sock])
        elif sock in self._replays.stream_of:
            self._on_replay_readable(self._replays.stream_of[sock])

    # --- sockets -------------------------------------------------------------------------

    def _open_bound(self) -> None:
        if self._settings.bind is None or self._bound is not None:
            return
        sock = self._new_sub()
        sock.bind(self._settings.bind)
        self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._bound = sock
        self._poller.register(sock)
        log.info("bound SUB on %s", self.bound_endpoint)

    def _new_sub(self) -> Socket:
        sock = self._zmq_context().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, _RECEIVE_HWM)
        sock.setsockopt(zmq.RECONNECT_IVL, int(self._settings.reconnect_min_s * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(self._settings.reconnect_max_s * 1000))
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        return sock

    def _reconcile(self, *, strict: bool = False) -> None:
        specs = self.pipeline.reconcile()
        if specs is None:
            return
        self._specs = list(specs)
        wanted = {r.id for r in specs}
        for replica in [r for r in self._sockets_of if r not in wanted]:
            self._close_replica(replica)
        self._open_replicas(strict=strict)

    def _open_replicas(self, *, strict: bool) -> None:
        """Open every registered replica without sockets. Out of files: ``strict`` raises
        :class:`SocketLimitError`; else one error line when the count left unopened changes."""
        unopened = [
            s
            for s in self._specs
            if s.events is not None and s.id not in self._sockets_of and self._owned_ranks(s)
        ]
        if strict and self.worker == 0:  # at start, for every worker: one line, the total
            process = [
                s for s in self._specs if s.events is not None and self._owned_ranks(s, True)
            ]
            if process:
                self._log_files_needed(sum(s.dp_size for s in process))
        error: SocketLimitError | None = None
        for spec in unopened:
            try:
                self._connect_replica(spec)
            except SocketLimitError as exc:
                if strict:
                    raise
                error = error or exc
        num_unopened = sum(s.id not in self._sockets_of for s in unopened)
        if error is not None and num_unopened != self._num_unopened:
            log.error("%d replicas not subscribed: %s", num_unopened, error)
        self._num_unopened = num_unopened

    def _log_files_needed(self, num_streams: int) -> None:
        needed, limit = files_needed(len(self._sub_of) + num_streams), file_limit()
        level = logging.WARNING if needed > limit.soft else logging.INFO
        message = "subscribing to %d streams: about %d open files, open-file limit %s"
        log.log(level, message, num_streams, needed, limit)

    def _connect_replica(self, spec: ReplicaSpec) -> None:
        """Every rank's SUB and monitor; out of files none stays open: :class:`SocketLimitError`."""
        sockets: list[Socket] = []
        pairs: list[tuple[StreamId, Socket, Socket]] = []
        ranks = self._owned_ranks(spec)
        try:
            for rank in ranks:
                sub = self._new_sub()
                sockets.append(sub)
                monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
                sockets.append(monitor)
                pairs.append((StreamId(spec.id, rank), sub, monitor))
        except zmq.ZMQError as exc:
            self._close_sockets(sockets)
            if not _out_of_files(exc):
                raise
            raise SocketLimitError(
                f"cannot open the sockets of replica {spec.id!r} ({len(self._sub_of)} streams"
                f" open): {exc.strerror}; {describe_limits(self._zmq_context())}"
            ) from None
        for stream, sub, monitor in pairs:
            self._subscribe(spec, stream, sub, monitor)
        self._sockets_of[spec.id] = sockets
        self._ranks_of[spec.id] = ranks

    def _subscribe(self, spec: ReplicaSpec, stream: StreamId, sub: Socket, monitor: Socket) -> None:
        endpoint = spec.events_for_rank(stream.rank)
        assert endpoint is not None
        sub.connect(endpoint)
        self._sub_of[sub] = stream
        self._monitor_of[monitor] = stream
        self._poller.register(sub)
        self._poller.register(monitor)
        self.pipeline.track(stream, spec)
        log.info("replica %s rank %d: connecting to %s", spec.id, stream.rank, endpoint)

    def _close_sockets(self, sockets: list[Socket]) -> None:
        for sock in sockets:
            if sock.type == zmq.SUB:
                sock.disable_monitor()
            sock.close(linger=0)

    def _close_replica(self, replica: str) -> None:
        self._ranks_of.pop(replica, None)
        for sock in self._sockets_of.pop(replica, []):
            self._poller.unregister(sock)
            if sock in self._sub_of:
                del self._sub_of[sock]
                sock.disable_monitor()
            self._monitor_of.pop(sock, None)
            sock.close(linger=0)

    def close(self) -> None:
        self.pipeline.close()
        for replica in list(self._sockets_of):
            self._close_replica(replica)
        for stream in list(self._replays.sessions):
            self._replays.end_replay(stream)
        if self._bound is not None:
            self._poller.unregister(self._bound)
            self._bound.close(linger=0)
            self._bound = None
        self._poller.close()

    # --- what the sockets deliver --------------------------------------------------------

    def _drain_sub(self, sock: Socket, stream: StreamId | None) -> None:
        messages: list[list[bytes]] = []
        for _ in range(_MAX_MESSAGES_PER_WAKE):
            try:
                messages.append(sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        self.pipeline.handle_frames(messages, stream)

    def _on_replay_readable(self, stream: StreamId) -> None:
        session = self._replays.sessions.get(stream)
        if session is not None:
            self.pipeline.on_replay(stream, session.receive())

    def _on_monitor(self, sock: Socket, stream: StreamId) -> None:
        while True:
            try:
                event = recv_monitor_message(sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_CONNECTED:
                self.pipeline.on_connected(stream)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.pipeline.on_disconnected(stream)


class Subscriber:
    """Subscribes to every replica and feeds the ingest workers' pipelines (one worker when
    sharded; ``num_workers`` overrides the setting). A worker whose thread ends other than by
    :meth:`stop` is restarted within :data:`_SUPERVISE_S`, its streams resynced."""

    def __init__(
        self,
        settings: IndexerSettings,
        index: BlockIndex,
        registry: Registry,
        *,
        context: Context | None = None,
        clock: Callable[[], float] = time.monotonic,
        shard: Shard | None = None,
        num_workers: int | None = None,
    ) -> None:
        num = 1 if shard is not None else (num_workers or settings.num_ingest_workers)
        self._given_context = context
        self._owned_context: Context | None = None
        self._context_lock = threading.Lock()
        self._stop = threading.Event()
        self.partition = StreamPartition(num)
        unrouted = UnroutedTotals(registry, num) if num > 1 else None
        self.loops = [
            SubscriberLoop(
                settings,
                index,
                registry,
                context=self._zmq_context,
                stop=self._stop,
                clock=clock,
                shard=shard,
                worker=i,
                partition=self.partition if num > 1 else None,
                publish_unrouted=None if unrouted is None else unrouted.publisher(i),
            )
            for i in range(num)
        ]
        self._threads: list[threading.Thread | None] = [None] * num
        self._supervisor: threading.Thread | None = None
        self._opened = False
        self.num_restarts = 0

    @property
    def pipeline(self) -> Pipeline:
        return self.loops[0].pipeline

    @property
    def pipelines(self) -> list[Pipeline]:
        return [loop.pipeline for loop in self.loops]

    @property
    def bound_endpoint(self) -> str | None:
        return self.loops[0].bound_endpoint

    @property
    def subscribed_replicas(self) -> list[str]:
        return sorted({r for loop in self.loops for r in loop.subscribed_replicas})

    def worker_of(self, stream: StreamId) -> int:
        return self.partition.worker_of(stream)

    # --- lifecycle -----------------------------------------------------------------------

    def open(self) -> None:
        """Open every worker's sockets without running the workers (errors surface here,
        every socket closed again); :meth:`start` does it if not done."""
        if self._opened:
            return
        try:
            for loop in self.loops:
                loop.open()
        except (SocketLimitError, zmq.ZMQError):
            self._close_all()
            raise
        self._opened = True
        log.info("ingest workers: %d", len(self.loops))

    def start(self) -> None:
        self.open()
        for worker in range(len(self.loops)):
            self._start_worker(worker)
        self._supervisor = threading.Thread(
            target=self._supervise, name="kvindex-ingest-supervisor", daemon=True
        )
        self._supervisor.start()

    @property
    def running(self) -> bool:
        return all(t is not None and t.is_alive() for t in self._threads)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in [self._supervisor, *self._threads]:
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        self._close_all()

    def run_once(self, timeout_ms: int = _POLL_MS) -> None:
        for loop in self.loops:
            loop.run_once(timeout_ms)

    def _start_worker(self, worker: int) -> None:
        thread = threading.Thread(
            target=self._run, args=(self.loops[worker],), name=f"kvindex-ingest-{worker}"
        )
        thread.daemon = True
        self._threads[worker] = thread
        thread.start()

    def _run(self, loop: SubscriberLoop) -> None:
        try:
            while not self._stop.is_set():
                try:
                    loop.run_once()
                except Exception:  # the loop must survive anything; the data is counted
                    log.exception("ingest worker %d: loop error (continuing)", loop.worker)
                    time.sleep(0.1)
        except BaseException:  # not re-raised: the supervisor restarts it
            log.critical("ingest worker %d died", loop.worker, exc_info=True)

    def _supervise(self) -> None:
        while not self._stop.wait(_SUPERVISE_S):
            for worker, thread in enumerate(self._threads):
                if thread is None or thread.is_alive() or self._stop.is_set():
                    continue
                # Logged before it is counted: whoever sees the count finds the line.
                log.error(
                    "ingest worker %d stopped unexpectedly: restarted, its streams resync"
                    " from the index (%d restarts)",
                    worker,
                    self.num_restarts + 1,
                )
                self.num_restarts += 1
                self.loops[worker].pipeline.restart()
                self._start_worker(worker)

    # --- the shared context --------------------------------------------------------------

    def _zmq_context(self) -> Context:
        """The context given, or the subscriber's own, opened on first use, sized to the
        open-file limit then, with an I/O thread per worker. Called from every worker."""
        if self._given_context is not None:
            return self._given_context
        with self._context_lock:
            if self._owned_context is None:
                context = sized_context(file_limit().soft)
                context.set(zmq.IO_THREADS, len(self.loops))
                self._owned_context = context
            return self._owned_context

    def _close_all(self) -> None:
        for loop in self.loops:
            loop.close()
        if self._owned_context is not None:
            self._owned_context.term()
            self._owned_context = None
