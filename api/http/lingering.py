"""A connection ended while its request's body still comes closes as nginx's lingering close
does: the answer, the write side shut, the rest of the body read and dropped until the client
closes, goes quiet or :attr:`LingeringProtocol.linger_s` is up; then the close.

Closing at once (a 413 for a body too large, a 408 for one too slow) leaves unread bytes in
the socket, and the kernel then resets the connection: a client still sending its body meets
the reset, and many never read the answer waiting behind it.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from kvindex.api.http.request_head import HeadDeadlineProtocol

QUIET_S = 2.0
"""A lingering connection that receives nothing this long is closed (nginx's
``lingering_timeout``, shortened: the client has the answer; only its unsent body is left)."""


class LingeringProtocol(HeadDeadlineProtocol):
    """uvicorn's protocol whose close after an answer, mid-body, lingers (see the module)."""

    linger_s: float = 10.0
    """At most this long draining one connection (``api.body_timeout_s``: the time a body
    within the limit may take)."""
    _in_message = False
    """A request has begun and its body is not read whole."""
    _linger_timer: asyncio.TimerHandle | None = None
    _linger_due = 0.0
    _last_read = 0.0
    _answer_transport: _AnswerTransport | None = None

    @property
    def lingering(self) -> bool:
        return self._linger_timer is not None

    def data_received(self, data: bytes) -> None:
        if self._linger_timer is not None:
            self._last_read = self.loop.time()  # dropped unparsed: the body of an answered request
            return
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        self._in_message = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not before and isinstance(cycle, RequestResponseCycle):
            if self._answer_transport is None:
                self._answer_transport = _AnswerTransport(self)
            cycle.transport = self._answer_transport  # its close after the answer lingers

    def on_message_complete(self) -> None:
        self._in_message = False
        super().on_message_complete()

    def end_connection(self) -> None:
        """Close after an answer: at once if the request was read whole, else lingering."""
        transport = self.transport
        if self._linger_timer is not None or transport.is_closing():
            return
        if not self._in_message:
            transport.close()
            return
        now = self._last_read = self.loop.time()
        self._linger_due = now + self.linger_s
        if transport.can_write_eof():
            transport.write_eof()  # the answer is whole: the client may stop sending
        self.flow.resume_reading()
        self._linger_timer = self.loop.call_at(min(self._linger_due, now + QUIET_S), self._due)

    def _due(self) -> None:
        due = min(self._linger_due, self._last_read + QUIET_S)
        if self.loop.time() < due:
            self._linger_timer = self.loop.call_at(due, self._due)
        else:
            self.transport.close()


class _AnswerTransport(asyncio.Transport):
    """The transport uvicorn writes an app's answer to: the connection's, but its close is
    :meth:`LingeringProtocol.end_connection`."""

    def __init__(self, protocol: LingeringProtocol) -> None:
        super().__init__()
        self._owner = protocol

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._owner.transport.write(data)

    def is_closing(self) -> bool:
        return self._owner.lingering or self._owner.transport.is_closing()

    def close(self) -> None:
        self._owner.end_connection()
