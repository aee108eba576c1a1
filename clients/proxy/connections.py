"""HTTP/1.1 keep-alive pools to the replicas, as an httpx transport on httptools, with httpx's
transport's contract: it returns at the answer's head; the raw body closed before its end
closes the connection; errors are httpx's; no timeout past connecting; TLS goes to httpx's.
A connection that ends before one byte of its answer raises :class:`NothingReceivedError`."""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import httptools
import httpx

_MAX_BUFFERED = 1 << 18
"""Body bytes read ahead of the forwarder before the connection stops reading."""
FRESH_CONNECTION = "kvindex.fresh_connection"
"""A request extension: true sends the request on a new connection (when the pool has room)."""


class NothingReceivedError(httpx.RemoteProtocolError):
    """The connection ended before one byte of the answer: the request may be sent again.
    ``reused``: it had served an answer before; ``abandoned``: the proxy closed it."""

    def __init__(self, message: str, *, reused: bool, abandoned: bool = False) -> None:
        super().__init__(message)
        self.reused = reused
        self.abandoned = abandoned


@dataclass(slots=True)
class _Hearing:
    """What one replica owes: its exchanges waiting for a head (→ loop time sent), and
    whether a byte came from it since :meth:`silent_s` last looked."""

    waiting: dict[_Connection, float] = field(default_factory=dict)
    heard: bool = False
    last_heard: float = 0.0

    def silent_s(self, now: float) -> float:
        """How long the replica has owed an answer with not one byte sent (0: it owes none)."""
        if self.heard:
            self.heard, self.last_heard = False, now
        if not self.waiting:
            return 0.0
        return max(0.0, now - max(self.last_heard, min(self.waiting.values())))


class _Connection(asyncio.Protocol):
    """One keep-alive connection: one request at a time, its answer parsed as it comes."""

    def __init__(self, on_lost: Callable[[_Connection], None], hearing: _Hearing) -> None:
        self._on_lost = on_lost
        self._hearing = hearing
        self._num_exchanges = 0
        self._received = False
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self.closed = False
        self._busy = False
        self._head_only = False
        self._interim = False
        self._head: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._chunks: deque[bytes] = deque()
        self._num_buffered = 0
        self._paused = False
        self._complete = False
        self._keep_alive = False
        self._error: Exception | None = None
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []

    # --- the request, from the forwarder's side ---------------------------------------------

    def usable(self) -> bool:
        transport = self._transport
        return not self.closed and transport is not None and not transport.is_closing()

    async def exchange(
        self, request: bytes, *, head_only: bool, until: float | None = None
    ) -> None:
        """Send ``request`` and wait for the answer's head (``head_only``: no body follows);
        ``TimeoutError`` when it has not come by ``until`` (loop time; None: no limit)."""
        assert self._transport is not None and not self._busy
        if self._head_only:  # the parser still waits for the body the last HEAD's head announced
            self._parser = httptools.HttpResponseParser(self)
        self._busy, self._head_only, self._complete, self._error = True, head_only, False, None
        self._keep_alive, self._received = False, False
        self._num_exchanges += 1
        self.status, self.headers = 0, []
        loop = asyncio.get_running_loop()
        head = self._head = loop.create_future()
        self._hearing.waiting[self] = loop.time()
        self._transport.write(request)
        late = None if until is None else loop.call_at(until, _late, head)
        try:
            await head
        except BaseException:
            self.close()
            raise
        finally:
            self._hearing.waiting.pop(self, None)
            if late is not None:
                late.cancel()

    def abandon(self, why: str) -> bool:
        """Give up the exchange waiting for its head with no byte received: it raises
        :class:`NothingReceivedError` and the connection closes (the replica sees an abort)."""
        head = self._head
        if not self._busy or self._received or head is None or head.done():
            return False
        self._fail(NothingReceivedError(why, reused=False, abandoned=True))
        self.close()
        return True

    async def body(self) -> AsyncIterator[bytes]:
        """The answer's body as it comes; raises ``RemoteProtocolError`` when it breaks."""
        while (chunk := await self.read()) is not None:
            yield chunk

    async def read(self, until: float | None = None) -> bytes | None:
        """The body's bytes come since the last read, joined (None: its end); raises
        ``RemoteProtocolError`` when it breaks, ``TimeoutError`` when nothing comes by
        ``until`` (loop time; None: no limit)."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._complete:
                return None
            if until is None:
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter
            else:
                await self.arrival(until)
        chunks = self._chunks
        chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._drained(len(chunk))
        return chunk

    def whole(self) -> bool:
        """The answer has all come, unbroken (its chunks may be unread)."""
        return self._complete and self._error is None

    async def arrival(self, until: float) -> None:
        """Return once a chunk unread, the answer's end or its break is here (at once if one
        is); ``TimeoutError`` when none is by ``until`` (loop time)."""
        if self._chunks or self._complete or self._error is not None:
            return
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        late = loop.call_at(until, _late, waiter)
        try:
            await waiter
        finally:
            late.cancel()

    def take_whole(self) -> bytes | None:
        """The chunks :meth:`body` has yet to give, once all came unbroken (None: nothing taken)."""
        if not (self._complete and self._error is None):
            return None
        chunks = self._chunks
        taken = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._drained(len(taken))
        return taken

    def all_read(self) -> bool:
        """The answer is complete and every chunk of it has been read."""
        return self._complete and self._error is None and not self._chunks

    def reusable(self) -> bool:
        """The answer was read to its end and both sides keep the connection alive."""
        return (
            self._complete
            and self._error is None
            and not self._chunks
            and self._keep_alive
            and self.usable()
        )

    def done(self) -> None:
        self._busy = False

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # --- asyncio's callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast("asyncio.Transport", transport)  # uvloop's: no subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:  # small writes go out at once (a request is one write)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if not self._busy:
            self.close()  # nothing may come on an idle connection: it is not HTTP any more
            return
        self._received = self._hearing.heard = True
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed answer from the replica: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._busy and not self._complete:
            head = self._head
            if head is not None and head.done() and self._until_close():
                self._complete = True  # an answer whose end is the connection's
                self._wake()
            elif not self._received:
                why = f"the connection ended before any byte of the answer ({exc or 'closed'})"
                self._fail(NothingReceivedError(why, reused=self._num_exchanges > 1))
            else:
                why = "the replica closed the connection before the answer's end"
                self._fail(httpx.RemoteProtocolError(why))
        self._on_lost(self)

    # --- httptools' callbacks ---------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        self._interim = 100 <= status < 200
        if self._interim:  # a 100 Continue and the like: the real head comes next
            self.headers = []
            return
        self.status = status
        if self._head_only:
            self._complete = True
            self._keep_alive = self._parser.should_keep_alive()
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._num_buffered += len(body)
        if self._num_buffered > _MAX_BUFFERED and self._transport is not None and not self._paused:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._complete = True
        self._keep_alive = self._parser.should_keep_alive()  # reset once the message is over
        self._wake()

    # --- helpers ------------------------------------------------------------------------------

    def _until_close(self) -> bool:
        """The answer's body ends with the connection (no length, not chunked)."""
        names = {n.lower() for n, _ in self.headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    def _drained(self, num_bytes: int) -> None:
        self._num_buffered -= num_bytes
        if self._paused and self._num_buffered <= _MAX_BUFFERED // 2 and self.usable():
            self._paused = False
            assert self._transport is not None
            self._transport.resume_reading()

    def _fail(self, error: Exception) -> None:
        self._error = error
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _late(waiter: asyncio.Future[None]) -> None:
    """The wait is over: TimeoutError (:func:`asyncio.timeout_at` for one future, no context)."""
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Pool:
    """At most ``max_connections`` to one replica, the idle reused last-in first-out."""

    def __init__(self, host: str, port: int, max_connections: int, connect_timeout_s: float):
        self._host, self._port = host, port
        self._max = max_connections
        self._connect_timeout_s = connect_timeout_s
        self._idle: list[_Connection] = []
        self._num_open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.hearing = _Hearing()

    def idle(self, *, fresh: bool = False) -> _Connection | None:
        """An idle connection as :meth:`acquire` would take it (None: it must open or wait)."""
        while self._idle and not (fresh and self._num_open < self._max):
            connection = self._idle.pop()
            if connection.usable():
                return connection
        return None

    async def acquire(self, *, fresh: bool = False) -> _Connection:
        """An idle connection, a new one, or the next one freed (``PoolTimeout``);
        ``fresh``: a new one while there is room."""
        while True:
            connection = self.idle(fresh=fresh)
            if connection is not None:
                return connection
            if self._num_open < self._max:
                return await self._connect()
            await self._freed()

    def give_back(self, connection: _Connection) -> None:
        """``connection``'s exchange is over: idle when it can serve again, else closed."""
        connection.done()
        if connection.reusable():
            self._idle.append(connection)
            self._wake_one()
        else:
            connection.close()  # counted out when it is lost

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def abandon(self, why: str) -> int:
        """Abandon every exchange waiting with no byte received (:meth:`_Connection.abandon`)."""
        return sum(connection.abandon(why) for connection in list(self.hearing.waiting))

    async def _connect(self) -> _Connection:
        self._num_open += 1
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self._lost, self.hearing), self._host, self._port
                )
        except BaseException as exc:
            self._num_open -= 1
            self._wake_one()
            where = f"{self._host}:{self._port}"
            if isinstance(exc, TimeoutError):
                raise httpx.ConnectTimeout(f"no connection to {where} in time") from exc
            if isinstance(exc, OSError):
                raise httpx.ConnectError(f"cannot connect to {where}: {exc}") from exc
            raise
        return connection

    async def _freed(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                await waiter
        except TimeoutError as exc:
            raise httpx.PoolTimeout(f"all {self._max} connections busy") from exc
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _lost(self, connection: _Connection) -> None:
        self._num_open -= 1
        if connection in self._idle:
            self._idle.remove(connection)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


class AnswerBody(httpx.AsyncByteStream):
    """An answer's body on its connection; closing it gives the connection back."""

    def __init__(self, pool: _Pool, connection: _Connection) -> None:
        self._pool = pool
        self._connection: _Connection | None = connection

    def whole(self) -> bool:
        """The body has all come: reading it waits for nothing."""
        connection = self._connection
        return connection is not None and connection.whole()

    def all_read(self) -> bool:
        """Every byte of the body has been read: nothing more will come."""
        connection = self._connection
        return connection is not None and connection.all_read()

    async def arrival(self, until: float) -> None:
        """Return once more of the body, its end or its break is here; ``TimeoutError``
        when none is by ``until`` (loop time)."""
        connection = self._connection
        if connection is not None:
            await connection.arrival(until)

    async def read(self, until: float | None = None) -> bytes | None:
        """Reference: the next chunk of ``__aiter__``; tests/unit/clients/proxy/test_connections.py::test_reads_with_a_time_limit_equal_the_bodys_chunks
        The body's bytes come since the last read (None: its end), ``TimeoutError`` when
        nothing comes by ``until`` (loop time)."""  # noqa: E501
        if self._connection is None:
            raise httpx.StreamClosed()
        return await self._connection.read(until)

    def take_whole(self) -> bytes | None:
        """Reference: b"".join of the chunks of ``__aiter__``; tests/unit/clients/proxy/test_connections.py::test_a_whole_body_taken_at_once_equals_its_chunks
        The body's bytes not read yet, at once, when it has all come (None: else)."""  # noqa: E501
        connection = self._connection
        return None if connection is None else connection.take_whole()

    def __aiter__(self) -> AsyncIterator[bytes]:
        if self._connection is None:
            raise httpx.StreamClosed()
        return self._connection.body()

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            self._pool.give_back(connection)


class ReplicaTransport(httpx.AsyncBaseTransport):
    """Reference: httpx.AsyncHTTPTransport; tests/integration/test_replica_transport.py::test_answers_equal_httpxs
    The replicas' connections, one pool per host and port."""  # noqa: E501

    def __init__(self, *, max_connections: int, connect_timeout_s: float) -> None:
        self._max_connections = max_connections
        self._connect_timeout_s = connect_timeout_s
        self._address_to_pool: dict[tuple[str, int], _Pool] = {}
        self._tls: httpx.AsyncHTTPTransport | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            return await self._tls_transport().handle_async_request(request)
        fresh = bool(request.extensions.get(FRESH_CONNECTION))
        head_only = request.method == "HEAD"
        pool, connection = await self._exchange(url, _encoded(request), head_only, fresh)
        return httpx.Response(
            connection.status,
            headers=connection.headers,
            stream=AnswerBody(pool, connection),
            request=request,
            extensions=_HTTP11,
        )

    async def send_raw(self, request: RawRequest, until: float | None = None) -> RawAnswer:
        """As :meth:`handle_async_request` for a ``POST`` in wire form (plain ``http``), with
        no httpx request or response built: a :class:`RawAnswer`; ``TimeoutError`` when its
        head has not come by ``until`` (loop time)."""
        fresh = bool(request.extensions.get(FRESH_CONNECTION))
        url = request.url
        pool, connection = await self._exchange(url, request.encoded, False, fresh, until)
        return RawAnswer(connection.status, connection.headers, AnswerBody(pool, connection))

    async def _exchange(
        self,
        url: httpx.URL,
        encoded: bytes,
        head_only: bool,
        fresh: bool,
        until: float | None = None,
    ) -> tuple[_Pool, _Connection]:
        """The connection whose answer's head has come (its body is the caller's)."""
        pool = self._pool(url.host, url.port or 80)
        connection = pool.idle(fresh=fresh)
        if connection is None and until is None:
            connection = await pool.acquire(fresh=fresh)
        elif connection is None:
            async with asyncio.timeout_at(until):  # a new connection, or one freed
                connection = await pool.acquire(fresh=fresh)
        try:
            await connection.exchange(encoded, head_only=head_only, until=until)
        except BaseException:
            pool.give_back(connection)  # closed by the failed exchange
            raise
        return pool, connection

    def silent_s(self, host: str, port: int, now: float) -> float:
        """How long ``host:port`` has owed an answer without a byte (0: none); loop time."""
        pool = self._address_to_pool.get((host, port))
        return 0.0 if pool is None else pool.hearing.silent_s(now)

    def abandon(self, host: str, port: int, why: str) -> int:
        """Abandon the exchanges waiting on ``host:port`` with no byte received: each raises
        :class:`NothingReceivedError` (``abandoned``) and its connection closes; how many."""
        pool = self._address_to_pool.get((host, port))
        return 0 if pool is None else pool.abandon(why)

    async def aclose(self) -> None:
        pools, self._address_to_pool = list(self._address_to_pool.values()), {}
        for pool in pools:
            pool.close()
        if self._tls is not None:
            await self._tls.aclose()

    def _pool(self, host: str, port: int) -> _Pool:
        pool = self._address_to_pool.get((host, port))
        if pool is None:
            pool = _Pool(host, port, self._max_connections, self._connect_timeout_s)
            self._address_to_pool[(host, port)] = pool
        return pool

    def _tls_transport(self) -> httpx.AsyncHTTPTransport:
        if self._tls is None:
            limits = httpx.Limits(
                max_connections=self._max_connections,
                max_keepalive_connections=self._max_connections,
            )
            self._tls = httpx.AsyncHTTPTransport(limits=limits, trust_env=False)
        return self._tls


@dataclass(slots=True)
class RawAnswer:
    """Reference: httpx.Response as ReplicaTransport.handle_async_request makes it; tests/integration/test_replica_transport.py::test_a_raw_answer_equals_httpxs_response
    An answer's head and its body on the connection: what the forwarder reads of a
    response, without building one."""  # noqa: E501

    status_code: int
    raw_headers: list[tuple[bytes, bytes]]
    """The header lines as the replica sent them."""
    stream: AnswerBody

    async def aclose(self) -> None:
        await self.stream.aclose()


@dataclass(slots=True)
class RawRequest:
    """A ``POST`` with a body in wire form (:func:`encoded_post`), for ``send_raw``."""

    url: httpx.URL
    encoded: bytes
    headers: list[tuple[str, str]]
    """What the head carries besides ``Host`` and ``Content-Length`` (as sent)."""
    extensions: dict[str, Any] = field(default_factory=dict)


def encoded_post(
    url: httpx.URL, headers: list[tuple[str, str]], body: bytes, encoding: str
) -> bytes:
    """Reference: _encoded(httpx.Request("POST", url, content=body, headers=httpx.Headers(headers, encoding=encoding))); tests/unit/clients/proxy/test_connections.py::test_encoded_post_equals_httpxs
    A ``POST`` of a non-empty ``body`` as one write, its head as httpx makes it (``Host``
    first, ``Content-Length`` last); ``LocalProtocolError`` as :func:`_encoded`."""  # noqa: E501
    fields = "\r\n".join([f"{n}: {v}" for n, v in headers]).encode(encoding)  # one encode
    lines = [b"POST %s HTTP/1.1" % url.raw_path, b"Host: " + url.netloc]
    if headers:
        lines.append(fields)
    lines.append(b"Content-Length: %d" % len(body))
    head = b"\r\n".join(lines)
    num_breaks = 2 + len(headers)  # between the request line, Host, each header, length
    if head.count(b"\n") != num_breaks or head.count(b"\r") != num_breaks:
        raise httpx.LocalProtocolError("a request header holds a line break")
    return b"".join((head, b"\r\n\r\n", body))


_HTTP11 = {"http_version": b"HTTP/1.1"}


def _encoded(request: httpx.Request) -> bytes:
    """The request's head and body as one write (httpx has set Host and Content-Length);
    ``LocalProtocolError`` when a header would break the head's lines (as h11 refuses)."""
    lines = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), request.url.raw_path)]
    lines += [b"%s: %s" % (name, value) for name, value in request.headers.raw]
    head = b"\r\n".join(lines)
    if head.count(b"\n") != len(lines) - 1 or head.count(b"\r") != len(lines) - 1:
        raise httpx.LocalProtocolError("a request header holds a line break")
    return head + b"\r\n\r\n" + request.content
