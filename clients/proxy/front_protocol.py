"""The proxy's server protocol: a plain ``POST`` to a forwarded route runs its endpoint on a
lean request cycle of its own (the body handed over whole, the answer's bytes written straight
to the connection) instead of uvicorn's; every other request goes to the app as before."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

from starlette.types import ASGIApp, Message, Scope
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE

from kvindex.api.http.server_protocol import ABORT, ON_GONE, HotProtocol

log = logging.getLogger("kvindex.proxy")
_NO_FRAMING = frozenset((204, 304))
_SERVER_ERROR = (
    b"content-type: text/plain; charset=utf-8\r\ncontent-length: 21\r\nconnection: close\r\n"
    b"\r\nInternal Server Error"
)
_DISCONNECT: Message = {"type": "http.disconnect"}
WHOLE_BODY = "kvindex.whole_body"
"""A scope extension of the front cycle: ``take()`` is the request's body when it has all
come (read: ``receive`` then gives no ``http.request``), else None (read it by ``receive``)."""


@dataclass(slots=True, eq=False)
class _FrontCycle:
    """One forwarded request as uvicorn's connection bookkeeping sees it (its ``cycle``)."""

    protocol: FrontProtocol
    endpoint: ASGIApp
    scope: Scope
    chunks: list[bytes] = field(default_factory=list)
    running: bool = False
    """The endpoint's task is made."""
    complete: bool = False
    """The body has come whole."""
    given: bool = False
    """The endpoint has read the body."""
    waiter: asyncio.Future[None] | None = None
    started: bool = False
    chunked: bool = False
    head: bytes | None = None
    """The answer's head, held until its body's first bytes go with it (a known length)."""
    response_complete: bool = False
    disconnected: bool = False
    keep_alive: bool = True
    message_event: _FrontCycle | None = None

    def __post_init__(self) -> None:
        self.message_event = self  # uvicorn calls ``cycle.message_event.set()`` on loss

    def set(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take_body(self) -> bytes | None:
        """The body, when it has come whole and not been read yet (None: else)."""
        if not self.complete or self.given:
            return None
        self.given = True
        chunks, self.chunks = self.chunks, []
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def receive(self) -> Message:
        while not self.given:
            if self.complete:
                self.given = True
                chunks = self.chunks
                body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                self.chunks = []
                return {"type": "http.request", "body": body, "more_body": False}
            if self.disconnected:
                return _DISCONNECT
            await self._wait()
        while not (self.disconnected or self.response_complete):
            await self._wait()
        return _DISCONNECT

    async def _wait(self) -> None:
        waiter = self.waiter
        if waiter is None:
            waiter = self.waiter = asyncio.get_running_loop().create_future()
        await waiter

    async def send(self, message: Message) -> None:
        protocol = self.protocol
        if self.disconnected:
            return
        if protocol.flow.write_paused:
            await protocol.flow.drain()
            if self.disconnected:
                return
        kind = message["type"]
        if kind == "http.response.start" and not self.started:
            self._start(message)
        elif kind == "http.response.body" and self.started and not self.response_complete:
            self._body(message)
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    def _start(self, message: Message) -> None:
        self.started = True
        self.head = self._head(message["status"], message.get("headers", ()))
        if self.chunked:  # a stream: its head goes at once
            self.protocol.transport.write(self.head)
            self.head = None

    def _body(self, message: Message) -> None:
        body, more = message.get("body", b""), message.get("more_body", False)
        if self.chunked:
            if body:
                body = b"%x\r\n%b\r\n" % (len(body), body)
            if not more:
                body += b"0\r\n\r\n"
        head, self.head = self.head, None
        data = body if head is None else head + body
        if data:
            self.protocol.transport.write(data)
        if not more:
            self._complete()

    def _head(self, status: int, headers: Any) -> bytes:
        lines = [STATUS_LINE[status], self.protocol.default_head()]
        length = False
        if not isinstance(headers, list | tuple):
            headers = list(headers)  # iterated twice
        _check(headers)
        for name, value in headers:
            lower = name.lower()
            if lower == b"content-length":
                length = True
            elif lower == b"connection" and value.lower() == b"close":
                self.keep_alive = False
                continue
            lines += (name, b": ", value, b"\r\n")
        if not length and status not in _NO_FRAMING and status >= 200:
            self.chunked = True
            lines.append(b"transfer-encoding: chunked\r\n")
        if not self.keep_alive:
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    def _complete(self) -> None:
        self.response_complete = True
        self.set()
        self.protocol.answered(self)

    def fail(self) -> None:
        """The endpoint raised or returned early: a 500 if nothing was sent, else the close."""
        protocol = self.protocol
        if self.response_complete:
            return
        self.response_complete = True
        if self.disconnected or protocol.transport.is_closing():
            return
        if not self.started:
            protocol.transport.write(STATUS_LINE[500] + protocol.default_head() + _SERVER_ERROR)
            protocol.end_connection()
        else:
            self.flush()
            protocol.transport.close()

    def flush(self) -> None:
        """The head held, written now (the answer breaks off before its body)."""
        head, self.head = self.head, None
        if head is not None:
            self.protocol.transport.write(head)


class FrontProtocol(HotProtocol):
    """uvicorn's protocol (the API's :class:`HotProtocol`) with the forwarded routes'
    plain requests (keep-alive HTTP/1.1, one ``Content-Length`` within ``max_body_bytes``,
    no query) run on a :class:`_FrontCycle`."""

    front: Mapping[bytes, ASGIApp] = {}
    """Exact request target → the route's ASGI endpoint."""
    max_body_bytes: int = 0
    _front_pending: _FrontCycle | None = None
    """The forwarded request whose body is still coming."""

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        cycle = self._front_pending
        if cycle is not None and not cycle.running:  # the body comes later: read by the task
            self._start(cycle)

    def on_headers_complete(self) -> None:
        endpoint = self._front_endpoint()
        if endpoint is None:
            super().on_headers_complete()
            return
        self._in_head = False
        self._disarm()
        path = self.url.decode("ascii")
        scope = cast(Scope, self.scope)
        scope["method"] = "POST"
        scope["path"] = path
        scope["raw_path"] = self.url
        scope["query_string"] = b""
        cycle = _FrontCycle(self, endpoint, scope)
        on_gone = partial(self._on_gone, cycle)
        scope["extensions"] = {
            ABORT: partial(self._abort, cycle),
            ON_GONE: on_gone,
            WHOLE_BODY: cycle.take_body,
        }
        self.cycle = cycle  # type: ignore[assignment]  # uvicorn reads the few fields it has
        self._front_pending = cycle

    def on_body(self, body: bytes) -> None:
        cycle = self._front_pending
        if cycle is None:
            super().on_body(body)
        else:
            cycle.chunks.append(body)

    def on_message_complete(self) -> None:
        cycle = self._front_pending
        if cycle is None:
            super().on_message_complete()
            return
        self._front_pending = None
        self._in_message = False
        cycle.complete = True
        if cycle.running:
            cycle.set()
        else:
            self._start(cycle)

    def connection_lost(self, exc: Exception | None) -> None:
        cycle, self._front_pending = self._front_pending, None
        if cycle is not None:
            cycle.disconnected = True
            cycle.set()
        super().connection_lost(exc)

    def _abort(self, cycle: Any) -> None:
        if isinstance(cycle, _FrontCycle) and not cycle.disconnected:
            cycle.flush()
        super()._abort(cycle)

    def default_head(self) -> bytes:
        return self._default_head()

    def answered(self, cycle: _FrontCycle) -> None:
        """After an answer's last bytes: close, or wait for the next request."""
        if self.transport.is_closing() or self.lingering:
            return
        if not cycle.keep_alive:
            self.end_connection()
            return
        self.on_response_complete()

    def _start(self, cycle: _FrontCycle) -> None:
        cycle.running = True
        task = self.loop.create_task(_run(cycle))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _front_endpoint(self) -> ASGIApp | None:
        endpoint = self.front.get(self.url)
        if endpoint is None or self.parser.get_method() != b"POST" or not self._plain():
            return None
        if self.parser.should_upgrade() or self.root_path:
            return None
        declared: bytes | None = None
        for name, value in self.headers:
            if name == b"content-length":
                if declared is not None:
                    return None
                declared = value
            elif name == b"transfer-encoding":
                return None
        if declared is None or not declared.isdigit() or int(declared) > self.max_body_bytes:
            return None
        return endpoint


def _check(headers: Any) -> None:
    """RuntimeError on a header uvicorn refuses (all names searched at once, joined by a
    byte their pattern allows, and all values so)."""
    names = b"-".join([name for name, _ in headers])
    values = b"\t".join([value for _, value in headers])
    if not (HEADER_RE.search(names) or HEADER_VALUE_RE.search(values)):
        return
    for name, value in headers:
        if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value):
            raise RuntimeError(f"invalid HTTP header {name!r}: {value!r}")  # as uvicorn


async def _run(cycle: _FrontCycle) -> None:
    """The endpoint on ``cycle``; what it leaves unanswered ends as uvicorn ends it."""
    path = cycle.scope["path"]
    try:
        await cycle.endpoint(cycle.scope, cycle.receive, cycle.send)
    except Exception:
        log.exception("answering %s failed", path)
        cycle.fail()
        return
    if not cycle.response_complete and not cycle.disconnected:
        log.error("answering %s ended without a whole answer", path)
        cycle.fail()


def front_protocol(
    base: type[HotProtocol], front: Mapping[str, ASGIApp], max_body_bytes: int
) -> type[FrontProtocol]:
    """``base`` (a :func:`~kvindex.api.http.server_protocol.hot_protocol` class) answering
    ``front``'s paths on the proxy's own cycle, bodies of at most ``max_body_bytes``."""
    targets = {path.encode("ascii"): endpoint for path, endpoint in front.items()}
    fields = {"front": targets, "max_body_bytes": max_body_bytes}
    return type("FrontHeadDeadline", (FrontProtocol, base), fields)
