"""The replicas' HTTP/1.1 connections, against a scripted server on a loopback port (and the
forwarder's answer on them)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import httpx
import pytest
from starlette.types import Message

from kvindex.api.http.server_protocol import ABORT
from kvindex.clients.proxy.connections import (
    FRESH_CONNECTION,
    AnswerBody,
    NothingReceivedError,
    ReplicaTransport,
    _encoded,
    encoded_post,
)
from kvindex.clients.proxy.forwarding import Forwarder, StreamedAnswer
from kvindex.clients.proxy.metrics import ProxyMetrics
from kvindex.clients.proxy.settings import ProxySettings
from kvindex.clients.proxy.upstream import Upstream

Script = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
"""How the server answers one request (its head and body given): writes, waits, closes."""
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"


class Replica:
    """A server answering every request on every connection with ``script``; counts the
    connections and the requests, and tells when a client closed its connection."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.num_connections = 0
        self.requests: list[bytes] = []
        self.client_closed = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Replica:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = _content_length(head)
                request = head + (await reader.readexactly(length) if length else b"")
                self.requests.append(request)
                await self.script(request, reader, writer)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.client_closed.set()
        finally:
            writer.close()


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def _run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 20))


def _transport(**overrides: Any) -> ReplicaTransport:
    settings: dict[str, Any] = {"max_connections": 8, "connect_timeout_s": 2.0} | overrides
    return ReplicaTransport(**settings)


async def _get(
    transport: ReplicaTransport, url: str, *, method: str = "POST", body: bytes = b"{}"
) -> tuple[int, bytes]:
    response = await transport.handle_async_request(httpx.Request(method, url, content=body))
    try:
        return response.status_code, b"".join([c async for c in response.aiter_raw()])
    finally:
        await response.aclose()


def _answer(answer: bytes) -> Script:
    async def script(_: bytes, __: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer)
        await writer.drain()

    return script


def test_answers_read_whole_reuse_their_connection_and_the_request_arrives_whole() -> None:
    async def test() -> None:
        async with Replica(_answer(OK)) as replica:
            transport = _transport()
            for number in range(3):
                url = f"{replica.url}/v1/x?q=1"
                answer = await _get(transport, url, body=b'{"n": %d}' % number)
                assert answer == (200, b"hello")
            await transport.aclose()
        assert replica.num_connections == 1
        head, _, body = replica.requests[2].partition(b"\r\n\r\n")
        assert head.startswith(b"POST /v1/x?q=1 HTTP/1.1\r\n") and body == b'{"n": 2}'
        assert b"\r\nhost: 127.0.0.1:" in head.lower() and b"content-length: 8" in head.lower()

    _run(test)


def test_a_chunked_answer_comes_chunk_by_chunk_as_it_is_sent() -> None:
    first_read = asyncio.Event()

    async def script(_: bytes, __: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        await asyncio.wait_for(first_read.wait(), 5)  # buffering would never get here
        writer.write(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n")
        await writer.drain()

    async def test() -> None:
        async with Replica(script) as replica:
            transport = _transport()
            response = await transport.handle_async_request(httpx.Request("GET", replica.url))
            chunks = []
            async for chunk in response.aiter_raw():
                chunks.append(chunk)
                first_read.set()
            await response.aclose()
            assert b"".join(chunks) == b"data: 1\n\ndata: 2\n\n" and chunks[0] == b"data: 1\n\n"
            assert await _get(transport, replica.url) == (200, b"data: 1\n\ndata: 2\n\n")
            assert replica.num_connections == 1
            await transport.aclose()

    _run(test)


def test_chunks_that_arrived_together_are_read_as_one_piece() -> None:
    async def script(_: bytes, __: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        events = b"".join(b"9\r\ndata: %d\n\n\r\n" % i for i in range(5))
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + events)
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(b"9\r\ndata: 5\n\n\r\n0\r\n\r\n")
        await writer.drain()

    async def test() -> None:
        async with Replica(script) as replica:
            transport = _transport()
            response = await transport.handle_async_request(httpx.Request("GET", replica.url))
            await asyncio.sleep(0.05)  # the first five events are in, the sixth is not
            chunks = [chunk async for chunk in response.aiter_raw()]
            await response.aclose()
            await transport.aclose()
        assert chunks == [b"".join(b"data: %d\n\n" % i for i in range(5)), b"data: 5\n\n"]

    _run(test)


def test_a_whole_body_taken_at_once_equals_its_chunks() -> None:
    """``take_whole`` gives what iterating the body would, once it has all come (before
    that None, and nothing is taken); taken, the rest is empty."""

    async def script(_: bytes, __: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        events = b"".join(b"9\r\ndata: %d\n\n\r\n" % i for i in range(3))
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + events)
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(b"9\r\ndata: 3\n\n\r\n0\r\n\r\n")
        await writer.drain()

    async def test() -> None:
        async with Replica(script) as replica:
            transport = _transport()
            bodies: list[bytes] = []
            for _ in range(2):
                request = httpx.Request("POST", replica.url, content=b"{}")
                response = await transport.handle_async_request(request)
                stream = response.stream
                assert isinstance(stream, AnswerBody)
                await asyncio.sleep(0.05)  # three events in, the fourth not
                assert stream.take_whole() is None
                if bodies:
                    await asyncio.sleep(0.2)  # all in now
                    assert stream.take_whole() == bodies[0]
                    assert stream.take_whole() == b""  # nothing left: an empty rest
                else:
                    bodies.append(b"".join([c async for c in response.aiter_raw()]))
                await response.aclose()
            assert replica.num_connections == 1  # taken whole, the connection serves again
            await transport.aclose()
        assert bodies == [b"".join(b"data: %d\n\n" % i for i in range(4))]

    _run(test)


def test_reads_with_a_time_limit_equal_the_bodys_chunks() -> None:
    """``read`` gives what iterating the body gives, chunk for chunk, then None; a wait
    past its limit raises TimeoutError and the next read goes on where it left off."""

    async def script(_: bytes, __: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        events = b"".join(b"9\r\ndata: %d\n\n\r\n" % i for i in range(3))
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + events)
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write(b"9\r\ndata: 3\n\n\r\n0\r\n\r\n")
        await writer.drain()

    async def chunks(transport: ReplicaTransport, url: str, limit_s: float) -> list[Any]:
        response = await transport.handle_async_request(httpx.Request("GET", url))
        stream = response.stream
        assert isinstance(stream, AnswerBody)
        loop = asyncio.get_running_loop()
        read: list[Any] = []
        await asyncio.sleep(0.05)  # three events in
        while True:
            try:
                chunk = await stream.read(loop.time() + limit_s)
            except TimeoutError:
                read.append("timeout")
                continue
            read.append(chunk)
            if chunk is None:
                break
        await response.aclose()
        return read

    async def test() -> None:
        async with Replica(script) as replica:
            transport = _transport()
            patient = await chunks(transport, replica.url, 2.0)
            hasty = await chunks(transport, replica.url, 0.1)
            response = await transport.handle_async_request(httpx.Request("GET", replica.url))
            iterated = [c async for c in response.aiter_raw()]
            await response.aclose()
            await transport.aclose()
        three = b"".join(b"data: %d\n\n" % i for i in range(3))
        assert patient == [three, b"data: 3\n\n", None]
        assert hasty[0] == three and hasty[-2:] == [b"data: 3\n\n", None]
        assert set(hasty[1:-2]) == {"timeout"}
        assert iterated == [three, b"data: 3\n\n"]

    _run(test)


def test_an_answer_closed_before_its_end_closes_its_connection() -> None:
    async def script(_: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        await reader.read()  # until the client closes
        raise ConnectionResetError

    async def test() -> None:
        async with Replica(script) as replica:
            transport = _transport()
            response = await transport.handle_async_request(httpx.Request("GET", replica.url))
            async for _ in response.aiter_raw():
                break
            await response.aclose()
            await asyncio.wait_for(replica.client_closed.wait(), 5)  # the replica sees it
            replica.script = _answer(OK)
            assert await _get(transport, replica.url) == (200, b"hello")
            assert replica.num_connections == 2
            await transport.aclose()

    _run(test)


def test_a_request_cancelled_before_the_head_closes_its_connection() -> None:
    async def script(_: bytes, reader: asyncio.StreamReader, __: asyncio.StreamWriter) -> None:
        await reader.read()
        raise ConnectionResetError

    async def test() -> None:
        async with Replica(script) as replica:
            transport = _transport()
            request = httpx.Request("GET", replica.url)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await transport.handle_async_request(request)
            await asyncio.wait_for(replica.client_closed.wait(), 5)
            await transport.aclose()

    _run(test)


def test_an_answer_without_length_ends_with_its_connection() -> None:
    async def test() -> None:
        until_close = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it"

        async def script(_: bytes, __: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.write(until_close)
            w.close()

        async with Replica(script) as replica:
            transport = _transport()
            assert await _get(transport, replica.url) == (200, b"all of it")
            assert await _get(transport, replica.url) == (200, b"all of it")
            assert replica.num_connections == 2
            await transport.aclose()

    _run(test)


def test_a_replica_that_closes_early_or_speaks_no_http_is_a_protocol_error() -> None:
    async def closes(_: bytes, __: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    async def short(_: bytes, __: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await writer.drain()
        writer.close()

    async def test() -> None:
        transport = _transport()
        async with Replica(closes) as replica:
            with pytest.raises(httpx.RemoteProtocolError):
                await _get(transport, replica.url)
        async with Replica(short) as replica:
            with pytest.raises(httpx.RemoteProtocolError):
                await _get(transport, replica.url)
        async with Replica(_answer(b"SSH-2.0-OpenSSH\r\n\r\n")) as replica:
            with pytest.raises(httpx.RemoteProtocolError):
                await _get(transport, replica.url)
        await transport.aclose()

    _run(test)


def test_connect_errors_and_timeouts_are_httpxs() -> None:
    async def test() -> None:
        transport = _transport(connect_timeout_s=0.3)
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            port = closed.getsockname()[1]  # bound, not listening: refused
            with pytest.raises(httpx.ConnectError):
                await _get(transport, f"http://127.0.0.1:{port}")
        with socket.socket() as full:
            full.bind(("127.0.0.1", 0))
            full.listen(0)  # never accepts: once its queue is full, a connect hangs
            fillers = [socket.socket() for _ in range(4)]
            try:
                for filler in fillers:
                    filler.setblocking(False)
                    filler.connect_ex(full.getsockname())
                with pytest.raises(httpx.ConnectTimeout):
                    await _get(transport, f"http://127.0.0.1:{full.getsockname()[1]}")
            finally:
                for filler in fillers:
                    filler.close()
        await transport.aclose()

    _run(test)


def test_the_pool_is_bounded_and_a_connection_freed_serves_the_next_request() -> None:
    async def test() -> None:
        async with Replica(_answer(OK)) as replica:
            transport = _transport(max_connections=1, connect_timeout_s=0.3)
            held = await transport.handle_async_request(httpx.Request("GET", replica.url))
            with pytest.raises(httpx.PoolTimeout):
                await _get(transport, replica.url)
            waiting = asyncio.ensure_future(_get(transport, replica.url))
            await asyncio.sleep(0.05)
            assert [c async for c in held.aiter_raw()] == [b"hello"]
            await held.aclose()
            assert await waiting == (200, b"hello")
            assert replica.num_connections == 1
            await transport.aclose()

    _run(test)


def test_a_head_answer_has_no_body_and_a_bad_header_is_refused() -> None:
    async def test() -> None:
        head_only = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"
        async with Replica(_answer(head_only)) as replica:
            transport = _transport()
            assert await _get(transport, replica.url, method="HEAD", body=b"") == (200, b"")
            bad = httpx.Request("GET", replica.url, headers={"x-evil": "a\r\nx-more: b"})
            with pytest.raises(httpx.LocalProtocolError):
                await transport.handle_async_request(bad)
            await transport.aclose()
        assert len(replica.requests) == 1

    _run(test)


def _streamed(script: Script, scope: dict[str, Any], **answer: Any) -> list[Message]:
    """The messages a client is sent for one request forwarded to a replica running
    ``script`` (a client that never leaves)."""
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def stays() -> Message:
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    async def test() -> None:
        async with Replica(script) as replica:
            forwarder = Forwarder(ProxySettings(), ProxyMetrics())
            upstreams = (Upstream("r1", replica.url),)
            opened = await forwarder.open("/", b"{}", [], upstreams, forwarder.deadline())
            streamed = StreamedAnswer(
                opened, "rid", forwarder.deadline(), lambda *a: None, **answer
            )
            await streamed(scope, stays, send)
            await forwarder.close()

    _run(test)
    return sent


def test_the_end_of_an_answer_goes_to_the_client_with_its_last_chunk() -> None:
    async def script(_: bytes, __: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n")
        await writer.drain()

    sent = _streamed(script, {"type": "http"})
    bodies = [(m["body"], m["more_body"]) for m in sent[1:]]
    assert bodies == [(b"data: 1\n\n", True), (b"data: 2\n\n", False)]


@pytest.mark.parametrize("late_s", [0.05, 3.0])
def test_a_body_of_known_length_after_its_head_goes_whole_or_is_cut_at_the_first_chunk_timeout(
    late_s: float,
) -> None:
    """A body that follows its head within the first-chunk timeout goes to the client in one
    message; one that does not comes to nothing and the answer is cut (the server's abort)."""
    aborted: list[bool] = []

    async def script(_: bytes, __: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(late_s)
        writer.write(b"hello")
        await writer.drain()

    scope = {"type": "http", "extensions": {ABORT: lambda: aborted.append(True)}}
    sent = _streamed(script, scope, first_chunk_timeout_s=0.5)
    bodies = [(m["body"], m["more_body"]) for m in sent[1:]]
    if late_s < 0.5:
        assert bodies == [(b"hello", False)] and not aborted
    else:
        assert bodies == [] and aborted == [True]


def test_a_connection_ending_before_any_byte_says_so_and_whether_it_served_before() -> None:
    async def once_then_close(
        request: bytes, _: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if b"first" in request:
            writer.write(OK)
            await writer.drain()
        else:
            writer.close()  # as a replica closing an idle connection as the request came

    async def short(_: bytes, __: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-le")
        await writer.drain()
        writer.close()

    async def test() -> None:
        transport = _transport()
        async with Replica(once_then_close) as replica:
            assert await _get(transport, replica.url, body=b"first") == (200, b"hello")
            with pytest.raises(NothingReceivedError) as stale:
                await _get(transport, replica.url)
            assert stale.value.reused and not stale.value.abandoned
            with pytest.raises(NothingReceivedError) as dropped:
                await _get(transport, replica.url)
            assert not dropped.value.reused  # a new connection, closed at once
        async with Replica(short) as replica:
            with pytest.raises(httpx.RemoteProtocolError) as broken:
                await _get(transport, replica.url)
            assert not isinstance(broken.value, NothingReceivedError)  # a byte came
        await transport.aclose()

    _run(test)


def test_a_request_asking_for_a_fresh_connection_gets_one() -> None:
    async def test() -> None:
        async with Replica(_answer(OK)) as replica:
            transport = _transport()
            assert await _get(transport, replica.url) == (200, b"hello")
            fresh = httpx.Request("POST", replica.url, extensions={FRESH_CONNECTION: True})
            response = await transport.handle_async_request(fresh)
            await response.aread()
            await response.aclose()
            assert replica.num_connections == 2
            await transport.aclose()

    _run(test)


def test_a_replica_owing_an_answer_grows_silent_until_a_byte_and_abandoning_ends_the_wait() -> None:
    async def hangs(request: bytes, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if b"quick" in request:
            w.write(OK)
            await w.drain()
        else:
            await reader.read()  # never answers

    async def test() -> None:
        loop = asyncio.get_running_loop()
        async with Replica(hangs) as replica:
            transport = _transport()
            assert transport.silent_s("127.0.0.1", replica.port, loop.time()) == 0.0
            waiting = asyncio.ensure_future(_get(transport, replica.url))
            while not replica.requests:
                await asyncio.sleep(0.01)
            assert await _get(transport, replica.url, body=b"quick") == (200, b"hello")
            assert transport.silent_s("127.0.0.1", replica.port, loop.time()) == 0.0  # heard
            await asyncio.sleep(0.1)
            assert transport.silent_s("127.0.0.1", replica.port, loop.time()) >= 0.1
            assert transport.abandon("127.0.0.1", replica.port, "hung") == 1
            with pytest.raises(NothingReceivedError) as abandoned:
                await waiting
            assert abandoned.value.abandoned and str(abandoned.value) == "hung"
            await asyncio.wait_for(replica.client_closed.wait(), 5)  # the replica sees it
            assert transport.silent_s("127.0.0.1", replica.port, loop.time()) == 0.0
            assert transport.abandon("127.0.0.1", replica.port, "hung") == 0
            await transport.aclose()

    _run(test)


@pytest.mark.parametrize(
    ("url", "headers"),
    [
        ("http://127.0.0.1:8001/v1/chat/completions", [("content-type", "application/json")]),
        ("http://replica/v1/completions?x=1", []),
        (
            "http://10.0.0.7:80/v1/x%20y",
            [("X-Odd", "caf\u00e9 \u00ff"), ("authorization", "Bearer k"), ("a", "")],
        ),
    ],
)
def test_encoded_post_equals_httpxs(url: str, headers: list[tuple[str, str]]) -> None:
    """The forwarder's own wire form of a POST is the bytes httpx's request would make."""
    body = b'{"model": "m"}'
    parsed = httpx.URL(url)
    reference = httpx.Request(
        "POST", parsed, content=body, headers=httpx.Headers(headers, encoding="latin-1")
    )
    assert encoded_post(parsed, headers, body, "latin-1") == _encoded(reference)
    with pytest.raises(httpx.LocalProtocolError):
        encoded_post(parsed, [("x", "a\r\nb: c")], body, "latin-1")
