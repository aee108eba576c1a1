"""Reference: ``httpx.AsyncClient.get`` and ``.post``; tests/unit/api/loop/test_probe.py::
test_as_httpx and test_a_post_as_httpx. Probes: the health checks' and load scrapes' GETs and
the replica tokenizers' POSTs, on kept-alive HTTP/1.1 read by httptools. One deadline bounds
the whole call (connect, head, body: a trickle too): TimeoutError; a body over
``max_body_bytes`` raises; errors are httpx's (the same messages); a URL other than plain
``http://host[:port]/path`` goes to the ``fallback`` httpx client."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools
import httpx

MAX_BODY_BYTES = 1 << 24
_MAX_IDLE = 16  # kept-alive connections a replica (checks, scrapes, tokenizer calls overlap)


class Answer(Protocol):
    """What a GET's caller reads (an ``httpx.Response`` is one)."""

    @property
    def status_code(self) -> int: ...

    @property
    def is_success(self) -> bool: ...

    @property
    def text(self) -> str: ...

    @property
    def content(self) -> bytes: ...


class Getter(Protocol):
    """What the checker and the scraper send GETs with (``httpx.AsyncClient`` is one)."""

    def get(self, url: str, *, timeout: float) -> Awaitable[Answer]: ...


@dataclass(frozen=True, slots=True)
class ProbeAnswer:
    status_code: int
    body: bytes

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    @property
    def content(self) -> bytes:
        return self.body


@dataclass(frozen=True, slots=True)
class _Target:
    host: str
    port: int
    get: bytes
    """The whole GET."""
    post: bytes
    """A JSON POST's head up to its ``Content-Length`` value."""


class Probes:
    """Kept-alive connections to the replicas, one call at a time on each (closed by aclose)."""

    def __init__(self, fallback: httpx.AsyncClient, *, max_body_bytes: int = MAX_BODY_BYTES):
        self._fallback = fallback
        self._max_body_bytes = max_body_bytes
        self._idle: dict[tuple[str, int], list[_Exchange]] = {}
        self._url_to_target: dict[str, _Target | None] = {}

    async def get(self, url: str, *, timeout: float) -> Answer:
        """The answer to ``GET url``, within ``timeout`` seconds in all."""
        target = self._target(url)
        if target is None:
            return await self._fallback.get(url, timeout=timeout)
        return await self._exchanged(target.host, target.port, target.get, timeout)

    async def post(self, url: str, body: bytes, *, timeout: float) -> Answer:
        """The answer to ``POST url`` of the JSON ``body``, as :meth:`get`: for a call that
        may be made twice (one on a kept-alive connection closed while idle is sent again)."""
        target = self._target(url)
        if target is None:
            headers = {"content-type": "application/json"}
            return await self._fallback.post(url, content=body, headers=headers, timeout=timeout)
        request = b"%s%d\r\n\r\n%s" % (target.post, len(body), body)
        return await self._exchanged(target.host, target.port, request, timeout)

    async def _exchanged(self, host: str, port: int, request: bytes, timeout: float) -> ProbeAnswer:
        async with asyncio.timeout(timeout):
            exchange, reused = await self._connection(host, port)
            try:
                answer = await exchange.send(request)
            except _StaleError as exc:
                if not reused:
                    raise httpx.RemoteProtocolError(str(exc)) from None
                exchange = await self._connect(host, port)  # closed while idle: once more
                answer = await _sent(exchange, request)
        if exchange.reusable():
            self._park(host, port, exchange)
        else:
            exchange.close()
        return answer

    async def aclose(self) -> None:
        for exchanges in self._idle.values():
            for exchange in exchanges:
                exchange.close()
        self._idle.clear()

    def _target(self, url: str) -> _Target | None:
        if url in self._url_to_target:
            return self._url_to_target[url]
        parts = urlsplit(url)
        target = None
        if parts.scheme == "http" and parts.hostname and "@" not in parts.netloc:
            try:
                port = parts.port or 80
            except ValueError:
                port = None
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            if port is not None and path.isascii() and " " not in path:
                host = f"Host: {parts.netloc}\r\nAccept: */*\r\n"
                get = f"GET {path} HTTP/1.1\r\n{host}\r\n"
                post = f"POST {path} HTTP/1.1\r\n{host}Content-Type: application/json\r\n"
                post += "Content-Length: "
                target = _Target(parts.hostname, port, get.encode(), post.encode())
        if len(self._url_to_target) < 10_000:
            self._url_to_target[url] = target
        return target

    async def _connection(self, host: str, port: int) -> tuple[_Exchange, bool]:
        idle = self._idle.get((host, port))
        while idle:
            exchange = idle.pop()
            if exchange.usable():
                return exchange, True
        return await self._connect(host, port), False

    async def _connect(self, host: str, port: int) -> _Exchange:
        loop = asyncio.get_running_loop()
        try:
            _, exchange = await loop.create_connection(
                lambda: _Exchange(self._max_body_bytes), host, port
            )
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        return exchange

    def _park(self, host: str, port: int, exchange: _Exchange) -> None:
        idle = self._idle.setdefault((host, port), [])
        idle[:] = [e for e in idle if e.usable()]  # closed by the replica while idle
        if len(idle) < _MAX_IDLE:
            idle.append(exchange)
        else:
            exchange.close()


async def _sent(exchange: _Exchange, request: bytes) -> ProbeAnswer:
    try:
        return await exchange.send(request)
    except _StaleError as exc:
        raise httpx.RemoteProtocolError(str(exc)) from None


class _StaleError(httpx.RemoteProtocolError):
    """A kept-alive connection ended before one byte of the answer (closed while idle)."""


class _Exchange(asyncio.Protocol):
    """One connection: a GET's answer parsed as it comes, its body bounded."""

    def __init__(self, max_body_bytes: int) -> None:
        self._max_body_bytes = max_body_bytes
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._answer: asyncio.Future[ProbeAnswer] | None = None
        self._body: list[bytes] = []
        self._num_body_bytes = 0
        self._status = 0
        self._received = False
        self._framed = False  # the answer's head gave its length, or chunks: not until close
        self._keep_alive = False
        self._closed = False

    def usable(self) -> bool:
        transport = self._transport
        return not self._closed and transport is not None and not transport.is_closing()

    def reusable(self) -> bool:
        return self._keep_alive and self.usable()

    async def send(self, request: bytes) -> ProbeAnswer:
        assert self._transport is not None and self._answer is None
        answer: asyncio.Future[ProbeAnswer] = asyncio.get_running_loop().create_future()
        self._answer = answer
        self._received = self._keep_alive = self._framed = False
        self._transport.write(request)
        try:
            return await answer
        except BaseException:
            self.close()  # cancelled (a deadline) or broken: never reused
            raise
        finally:
            self._answer = None
            self._body, self._num_body_bytes, self._status = [], 0, 0

    def close(self) -> None:
        self._closed = True
        if self._transport is not None:
            self._transport.close()

    # --- asyncio's callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast("asyncio.Transport", transport)  # uvloop's: no subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self._answer is None:
            self.close()  # bytes on an idle connection: it is not HTTP any more
            return
        self._received = True
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if self._answer is None or self._answer.done():
            return
        if not self._received:
            why = f"the connection ended before any byte of the answer ({exc or 'closed'})"
            self._fail(_StaleError(why))
        elif self._status and not self._framed:
            self._finish()  # an answer whose end is the connection's
        else:
            self._fail(httpx.RemoteProtocolError("the connection ended before the answer's end"))

    # --- httptools' callbacks ---------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            self._framed = False  # a 100 Continue and the like: the real head comes next
            return
        self._status = status

    def on_body(self, body: bytes) -> None:
        self._num_body_bytes += len(body)
        if self._num_body_bytes > self._max_body_bytes:
            self._fail(httpx.RemoteProtocolError(f"answer over {self._max_body_bytes} bytes"))
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._status:
            self._keep_alive = self._parser.should_keep_alive()
            self._finish()

    def _finish(self) -> None:
        answer = self._answer
        if answer is not None and not answer.done():
            answer.set_result(ProbeAnswer(self._status, b"".join(self._body)))

    def _fail(self, error: Exception) -> None:
        answer = self._answer
        if answer is not None and not answer.done():
            answer.set_exception(error)
        self.close()
