"""A request head must arrive whole in time: uvicorn's HTTP protocol with a deadline."""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("kvindex.api")


class HeadDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol; a request head must arrive within :attr:`timeout_s`."""

    timeout_s: float = 10.0
    num_closed = 0
    """Connections closed for a late head, over every server of the process."""
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    _in_head = False
    """A request has begun and its headers are not complete."""

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            self._arm()  # the head must now arrive in time (armed once, by its first bytes)

    def on_message_begin(self) -> None:
        self._in_head = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        super().on_headers_complete()

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.timeout_s, self._head_too_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        HeadDeadlineProtocol.num_closed += 1
        log.warning(
            "closed a connection from %s: no whole request head within %.1fs "
            "(api.header_timeout_s)",
            self.client,
            self.timeout_s,
        )
        self.transport.close()


def head_deadline_protocol(timeout_s: float) -> type[HeadDeadlineProtocol]:
    return type("HeadDeadline", (HeadDeadlineProtocol,), {"timeout_s": timeout_s})
