"""A vLLM-compatible KV-event publisher (vLLM's ``ZmqEventPublisher`` without vLLM): PUB
sends, ROUTER replays, in every layout :mod:`kvindex.indexer.ingest.wire` writes."""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass

import zmq

from kvindex.indexer.domain.events import Event
from kvindex.indexer.ingest.wire import (
    Encoding,
    ReplayLayout,
    WireError,
    decode_replay_request,
    encode_batch,
    encode_live,
    encode_replay_end,
    encode_replay_reply,
)


@dataclass(frozen=True, slots=True)
class _Outgoing:
    seq: int
    payload: bytes
    drop: bool
    raw: list[bytes] | None = None


_IDLE = _Outgoing(-1, b"", False)


class EventPublisher:
    """Publishes batches like one vLLM engine (one data-parallel rank)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        rank: int = 0,
        encoding: Encoding = "map",
        replay_layout: ReplayLayout = "topic",
        buffer_steps: int = 10_000,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        bind: bool | None = None,
        send_hwm: int = 0,
        send_buffer_bytes: int = 0,
    ) -> None:
        """``bind`` None: vLLM's rule (:func:`_open`); ``send_hwm`` 0: unbounded;
        ``send_buffer_bytes`` 0: the OS's."""
        self._bind = bind
        self._send_hwm = send_hwm
        self._send_buffer_bytes = send_buffer_bytes
        self._context = context or zmq.Context.instance()
        self.topic = topic.encode()
        self.rank = rank
        self.encoding: Encoding = encoding
        self.replay_layout: ReplayLayout = replay_layout
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._outbox: queue.Queue[_Outgoing | None] = queue.Queue()
        self._next_seq = 0
        self.muted = False
        self._lock = threading.Lock()
        self._pub = self._context.socket(zmq.PUB)
        self._router: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        try:
            self._open_sockets(endpoint, replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._loop, name="kv-publisher", daemon=True)
        self._thread.start()

    def _open_sockets(self, endpoint: str, replay_endpoint: str | None) -> None:
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, self._send_hwm)
        if self._send_buffer_bytes:
            self._pub.setsockopt(zmq.SNDBUF, self._send_buffer_bytes)
        self.endpoint = _open(self._pub, endpoint, self._bind)
        if replay_endpoint is not None:
            self._router = self._context.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.SNDHWM, 0)
            self._router.bind(replay_endpoint)
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)

    def publish(self, events: list[Event], *, ts: float | None = None, drop: bool = False) -> int:
        """Queue one batch; its seq. ``drop=True``: kept for replay, never sent live (a gap)."""
        payload = encode_batch(
            events, ts=time.time() if ts is None else ts, rank=self.rank, encoding=self.encoding
        )
        return self.publish_payload(payload, drop=drop)

    def publish_payload(self, payload: bytes, *, drop: bool = False) -> int:
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
        self._outbox.put(_Outgoing(seq, payload, drop))
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        """Send arbitrary frames on the PUB socket (malformed-input tests)."""
        self._outbox.put(_Outgoing(-1, b"", False, frames))

    def mute(self) -> None:
        """Send nothing and answer no replay from now on (the sockets stay open)."""
        self.muted = True

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until everything queued so far has been sent."""
        deadline = time.monotonic() + timeout_s
        while not self._outbox.empty() and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.005)

    def close(self) -> None:
        self._outbox.put(None)
        self._thread.join(5)
        self._close_sockets()

    def _loop(self) -> None:
        while True:
            try:
                item = self._outbox.get(timeout=0.005)
            except queue.Empty:
                item = _IDLE
            if item is None:
                return
            self._send(item)
            self._serve_replay()

    def _send(self, item: _Outgoing) -> None:
        if item.raw is not None:
            self._pub.send_multipart(item.raw)
        elif item.seq >= 0 and not self.muted:
            self._buffer.append((item.seq, item.payload))
            if not item.drop:
                self._pub.send_multipart(encode_live(self.topic, item.seq, item.payload))

    def _serve_replay(self) -> None:
        router = self._router
        if router is None:
            return
        while router.poll(0, zmq.POLLIN):
            identity, *request = router.recv_multipart()
            if self.muted:
                continue
            try:
                start = decode_replay_request(request)
            except WireError:
                continue  # vLLM logs "Invalid replay request" and answers nothing
            layout, topic = self.replay_layout, self.topic
            for seq, payload in list(self._buffer):
                if seq >= start:
                    reply = encode_replay_reply(seq, payload, topic=topic, layout=layout)
                    router.send_multipart([identity, b"", *reply])
            router.send_multipart([identity, b"", *encode_replay_end(layout)])


def _open(sock: zmq.Socket[bytes], endpoint: str, bind: bool | None) -> str:
    """Bind or connect; ``bind`` None: vLLM's rule (bind when it has ``*``, ``::``, ipc, inproc)."""
    if bind is None:
        bind = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
    if bind:
        sock.bind(endpoint)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.connect(endpoint)
    return endpoint
