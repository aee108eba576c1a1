"""ZeroMQ side of the write path: sockets, topologies, reconnects. Nothing else.

Two topologies, as vLLM allows (both may be used at once):

* **connect** — a replica's ``endpoint`` binds (``tcp://*:5557``, vLLM's default); the
  indexer connects one SUB per (replica, data-parallel rank), rank r at port + r. The
  stream is known from the socket; a socket monitor tells connects from disconnects.
* **bind** — the indexer binds one SUB (``settings.bind``); replicas connect to it (a vLLM
  endpoint without ``*``). Each stream is known from its topic ``kv@<replica>@<model>``
  and the batch's data-parallel rank, and is registered on its first event.

Replays use one DEALER per replay (:class:`~kvindex.indexer.replay.ReplaySession`).

One thread runs the loop: it owns every socket and the
:class:`~kvindex.indexer.pipeline.Pipeline`, which decides everything else (ordering,
replays, registration, purges, recovery). The loop hands the pipeline what the sockets
deliver and carries out its replay requests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvindex.indexer.events import StreamId
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.protocol import BlockIndex
from kvindex.indexer.pipeline import Pipeline
from kvindex.indexer.replay import ReplaySession
from kvindex.indexer.settings import IndexerSettings

log = logging.getLogger("kvindex.subscriber")

_POLL_MS = 50
_MAX_MESSAGES_PER_WAKE = 1024
_MAINTENANCE_EVERY_S = 1.0

Context = zmq.Context[zmq.Socket[bytes]]
Socket = zmq.Socket[bytes]


class _ReplaySockets:
    """The pipeline's :class:`~kvindex.indexer.pipeline.ReplayRequests`: one DEALER per open
    replay, polled by the loop. Used from the loop's thread only."""

    def __init__(
        self, context: Context, poller: zmq.Poller, timeout_s: float, clock: Callable[[], float]
    ) -> None:
        self._context = context
        self._poller = poller
        self._timeout_s = timeout_s
        self._clock = clock
        self.sessions: dict[StreamId, ReplaySession] = {}
        self.stream_of: dict[Socket, StreamId] = {}

    def start_replay(self, stream: StreamId, endpoint: str, start_seq: int) -> None:
        session = ReplaySession(
            self._context, endpoint, start_seq, idle_timeout_s=self._timeout_s, clock=self._clock
        )
        self.sessions[stream] = session
        self.stream_of[session.socket] = stream
        self._poller.register(session.socket, zmq.POLLIN)

    def end_replay(self, stream: StreamId) -> int:
        session = self.sessions.pop(stream, None)
        if session is None:
            return 0
        self._poller.unregister(session.socket)
        del self.stream_of[session.socket]
        session.close()
        return session.num_bad_frames


class Subscriber:
    """Subscribes to every replica and feeds what arrives to a :class:`Pipeline`."""

    def __init__(
        self,
        settings: IndexerSettings,
        index: BlockIndex,
        registry: Registry,
        *,
        context: Context | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._context = context or zmq.Context.instance()
        self._clock = clock
        self._poller = zmq.Poller()
        self._replays = _ReplaySockets(
            self._context, self._poller, settings.replay_timeout_s, clock
        )
        self.pipeline = Pipeline(settings, index, registry, replays=self._replays, clock=clock)
        self._sub_of: dict[Socket, StreamId] = {}
        self._monitor_of: dict[Socket, StreamId] = {}
        self._sockets_of: dict[str, list[Socket]] = {}
        self._bound: Socket | None = None
        self._next_maintenance = 0.0
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

    @property
    def running(self) -> bool:
        """True while the loop thread runs (started, not ended)."""
        return self._thread is not None and self._thread.is_alive()

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
        """One loop turn: reconcile replicas, poll, handle, expire, maintain.

        It waits up to ``timeout_ms`` for a socket (or for :meth:`stop`): with no socket
        registered ``zmq.Poller.poll`` returns at once, which would spin a core.
        """
        self._reconcile()
        if not self._poller.sockets:
            self._stop.wait(timeout_ms / 1000)
        for sock, _ in self._poller.poll(timeout_ms):
            self._dispatch(sock)
        self._expire_replays()
        now = self._clock()
        if now >= self._next_maintenance:
            self._next_maintenance = now + _MAINTENANCE_EVERY_S
            self.pipeline.maintain()

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
        self._poller.register(sock, zmq.POLLIN)
        log.info("bound SUB on %s", self.bound_endpoint)

    def _new_sub(self) -> Socket:
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, int(self._settings.reconnect_min_s * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(self._settings.reconnect_max_s * 1000))
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        return sock

    def _reconcile(self) -> None:
        """When the registry changed: open SUBs for new replicas, close removed ones'."""
        specs = self.pipeline.reconcile()
        if specs is None:
            return
        wanted = {r.id for r in specs}
        for replica in [r for r in self._sockets_of if r not in wanted]:
            self._close_replica(replica)
        for spec in specs:
            if spec.events is not None and spec.id not in self._sockets_of:
                self._connect_replica(spec)

    def _connect_replica(self, spec: ReplicaSpec) -> None:
        sockets: list[Socket] = []
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
            self.pipeline.track(stream, spec)
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

    def _close_all(self) -> None:
        self.pipeline.close()
        for replica in list(self._sockets_of):
            for sock in self._sockets_of.pop(replica):
                if sock in self._sub_of:
                    sock.disable_monitor()
                sock.close(linger=0)
        for stream in list(self._replays.sessions):
            self._replays.end_replay(stream)
        if self._bound is not None:
            self._bound.close(linger=0)
            self._bound = None

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

    def _expire_replays(self) -> None:
        expired = [s for s, session in self._replays.sessions.items() if session.expired()]
        for stream in expired:
            self.pipeline.replay_timed_out(stream)

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
