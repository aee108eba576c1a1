"""A request head, as the server reads it: it must arrive whole in time, and an ``Upgrade``
in it is ignored (RFC 9110 §7.8: kvindex speaks no protocol but HTTP/1.1).

uvicorn's httptools parser ends a message that asks to upgrade at its head (llhttp takes the
rest of the bytes for the new protocol): the body of a ``POST`` carrying ``Upgrade: h2c``, as
``curl --http2`` sends it, was lost. Here such a head is parsed again without its ask (the
``Upgrade`` header, ``upgrade`` in ``Connection``), so the request is read whole, body and all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger("kvindex.api")
_CONNECT = b"CONNECT"
"""The one method llhttp always takes as an upgrade (a tunnel): answered as uvicorn does."""


class HeadDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol; a request head must arrive within :attr:`timeout_s`,
    and no request is upgraded (its ``Upgrade`` header is ignored)."""

    timeout_s: float = 10.0
    num_closed = 0
    """Connections closed for a late head, over every server of the process."""
    _head_timer: asyncio.TimerHandle | None = None
    _unupgraded: bytes | None = None
    """The head of a request that asked to upgrade, without the ask: to be parsed again."""
    bad_request_body: Callable[[str], bytes] | None = None
    """The JSON body of the 400 answering bytes the parser refuses, from uvicorn's message
    (None: uvicorn's plain text); the server's other errors come in the same shape."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    _in_head = False
    """A request has begun and its headers are not complete."""

    def data_received(self, data: bytes) -> None:
        """uvicorn's, but a request asking to upgrade is parsed again as a plain one."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        except httptools.HttpParserUpgrade as exc:
            head, self._unupgraded = self._unupgraded, None
            if head is not None:  # else a CONNECT, answered (by the app) as uvicorn does
                self.parser = _parser(self)
                self.data_received(head + data[exc.args[0] :])
                return
        if self._in_head and not self.transport.is_closing():
            self._arm()  # the head must now arrive in time (armed once, by its first bytes)

    def _should_upgrade(self) -> bool:
        return False

    def send_400_response(self, msg: str) -> None:
        """uvicorn's 400 (then close), its body in :attr:`bad_request_body`'s shape."""
        shape = self.bad_request_body
        if shape is None:
            super().send_400_response(msg)
            return
        body = shape(msg)
        head = [STATUS_LINE[400]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(
            b"content-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % len(body)
        )
        self.transport.write(b"".join([*head, body]))
        self.transport.close()

    def on_message_begin(self) -> None:
        self._in_head = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        if self.parser.should_upgrade() and self.parser.get_method() != _CONNECT:
            # The parser ends this message here, its body unread: nothing is started for it.
            self._unupgraded = self._head_without_upgrade()
            return
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        if self._unupgraded is None:
            super().on_message_complete()

    def _head_without_upgrade(self) -> bytes:
        """The head as received (names lower-cased), less its ask to upgrade: a head that
        cannot upgrade (llhttp upgrades on ``Upgrade`` with ``upgrade`` in ``Connection``)."""
        version = self.parser.get_http_version().encode()
        lines = [b"%s %s HTTP/%s\r\n" % (self.parser.get_method(), self.url, version)]
        for name, value in self.headers:
            kept = _without_upgrade(value) if name == b"connection" else value
            if name != b"upgrade" and (kept or name != b"connection"):
                lines.append(b"%s: %s\r\n" % (name, kept))
        lines.append(b"\r\n")
        return b"".join(lines)

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


def _without_upgrade(connection: bytes) -> bytes:
    """A ``Connection`` value less its ``upgrade`` token (empty if nothing else is left)."""
    tokens = [t for t in connection.split(b",") if t.strip().lower() != b"upgrade"]
    return b",".join(tokens).strip()


def _parser(protocol: HttpToolsProtocol) -> httptools.HttpRequestParser:
    """A fresh parser calling back ``protocol``, set up as uvicorn sets up its own."""
    parser = httptools.HttpRequestParser(protocol)
    parser.set_dangerous_leniencies(lenient_data_after_close=True)
    return parser


def head_deadline_protocol(timeout_s: float) -> type[HeadDeadlineProtocol]:
    return type("HeadDeadline", (HeadDeadlineProtocol,), {"timeout_s": timeout_s})
