"""The client side of vLLM's replay protocol: a fresh DEALER per replay (so a late answer to
an abandoned one is never taken for the next), with a timeout (vLLM answers nothing to a
malformed request)."""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.events import EventBatch
from kvindex.indexer.ingest.wire import ReplayReply, WireError, decode_replay, encode_replay_request


class ReplayTimeoutError(KvIndexError):
    """The replay did not reach its end marker in time."""


class ReplaySession:
    """One in-flight replay. Poll :attr:`socket`; call :meth:`receive` when readable."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        start_seq: int,
        *,
        idle_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoint = endpoint
        self.start_seq = start_seq
        self._clock = clock
        self._idle_timeout_s = idle_timeout_s
        self.socket: zmq.Socket[bytes] = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.connect(endpoint)
        self.socket.send_multipart(encode_replay_request(start_seq))
        self.deadline = clock() + idle_timeout_s
        self.num_bad_frames = 0

    def receive(self) -> list[ReplayReply]:
        """Every reply waiting now (non-blocking; undecodable ones counted and skipped)."""
        replies: list[ReplayReply] = []
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.deadline = self._clock() + self._idle_timeout_s
            try:
                replies.append(decode_replay(frames))
            except WireError:
                self.num_bad_frames += 1
        return replies

    def expired(self) -> bool:
        return self._clock() > self.deadline

    def close(self) -> None:
        self.socket.close(linger=0)


def fetch_replay(
    context: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    start_seq: int,
    *,
    timeout_s: float = 5.0,
) -> list[EventBatch]:
    """Blocking replay: every batch from ``start_seq`` to the end marker, in order; raises
    :class:`ReplayTimeoutError` after ``timeout_s`` without a reply."""
    session = ReplaySession(context, endpoint, start_seq, idle_timeout_s=timeout_s)
    batches: list[EventBatch] = []
    try:
        while True:
            wait_ms = max(0, int((session.deadline - time.monotonic()) * 1000))
            if not session.socket.poll(wait_ms, zmq.POLLIN):
                raise ReplayTimeoutError(f"replay from {endpoint} (seq {start_seq}) timed out")
            for reply in session.receive():
                if reply.batch is None:
                    return batches
                batches.append(reply.batch)
    finally:
        session.close()
