"""The proxy's ``ReplicaTransport`` against its reference, ``httpx.AsyncHTTPTransport``: the
same requests through an ``httpx.AsyncClient`` on each, to one real uvicorn server on a
loopback port, give the same statuses, headers (but Date and Server), bytes, chunks, errors
and connection reuse. Where the copy differs on purpose (its module docstring: no timeout past
connecting), the difference itself is asserted."""

from __future__ import annotations

import asyncio
import json
import queue
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvindex.api.http.background import BackgroundServer
from kvindex.clients.proxy.connections import RawRequest, ReplicaTransport, encoded_post
from kvindex.clients.proxy.settings import ProxySettings

Headers = list[tuple[bytes, bytes]]
PORT = b"x-client-port"
UNCOMPARED = {b"date", b"server", PORT}
"""Headers that differ by the hour or by the connection, not by the transport."""
NUM_CHUNKS = 3


class Replica:
    """An ASGI app with one route per kind of answer; each answer tells the client's port.
    ``/stream`` sends its next chunk once the client has acknowledged the last in ``acks``."""

    def __init__(self) -> None:
        self.acks: queue.Queue[None] = queue.Queue()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        port = (PORT, str(scope["client"][1]).encode())
        if scope["path"] in ("/stream", "/hang", "/slow"):
            await self._timed(scope["path"], port, receive, send)
        else:
            await self._plain(scope, body, port, send)

    async def _plain(
        self, scope: dict[str, Any], body: bytes, port: tuple[bytes, bytes], send: Any
    ) -> None:
        path = scope["path"]
        if path == "/echo":
            seen = {
                "method": scope["method"],
                "query": scope["query_string"].decode(),
                "headers": [[n.decode(), v.decode()] for n, v in scope["headers"]],
                "body": body.decode(),
            }
            echo = json.dumps(seen).encode()
            repeated = [(b"x-echo", b"one"), (b"set-cookie", b"a=1"), (b"x-echo", b"two")]
            await _answer(
                send, 200, [(b"content-type", b"application/json"), *repeated, port], echo
            )
        elif path == "/doc":
            await _answer(send, 200, [(b"content-type", b"text/plain"), port], b"hello world")
        elif path == "/missing":
            await _answer(send, 404, [(b"content-type", b"text/plain"), port], b"no such page")
        elif path == "/busy":  # no content-length: chunked
            await send(
                _start(503, [(b"content-type", b"application/json"), (b"retry-after", b"1"), port])
            )
            await send({"type": "http.response.body", "body": b'{"error": "busy"}'})
        elif path == "/empty":
            await send(_start(204, [port]))
            await send({"type": "http.response.body", "body": b""})

    async def _timed(self, path: str, port: tuple[bytes, bytes], receive: Any, send: Any) -> None:
        if path == "/stream":
            await send(_start(200, [(b"content-type", b"text/event-stream"), port]))
            for number in range(NUM_CHUNKS):
                chunk = b"data: %d\n\n" % number
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await asyncio.to_thread(self.acks.get, True, 5)
            await send({"type": "http.response.body", "body": b""})
        elif path == "/hang":  # one chunk, then nothing until the client goes
            await send(_start(200, [port]))
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            assert (await asyncio.wait_for(receive(), 5))["type"] == "http.disconnect"
        elif path == "/slow":
            await asyncio.sleep(0.5)
            await _answer(send, 200, [port], b"late")


def _start(status: int, headers: Headers) -> dict[str, Any]:
    return {"type": "http.response.start", "status": status, "headers": headers}


async def _answer(send: Any, status: int, headers: Headers, body: bytes) -> None:
    length = (b"content-length", str(len(body)).encode())
    await send(_start(status, [*headers, length]))
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def replica() -> Iterator[tuple[Replica, str]]:
    app = Replica()
    with BackgroundServer(app, lifespan="off") as server:
        yield app, server.base_url


def _replica_transport() -> ReplicaTransport:
    """As the proxy's forwarder builds it, from the settings' defaults."""
    settings = ProxySettings()
    return ReplicaTransport(
        max_connections=settings.max_connections, connect_timeout_s=settings.connect_timeout_s
    )


@dataclass(frozen=True)
class Seen:
    """One exchange as a client sees it; ``connection`` numbers the connections in order;
    ``chunks`` only where the server paces them (elsewhere their cut is the socket reads')."""

    what: str
    status: int
    reason: str
    http_version: str
    headers: Headers
    body: bytes
    chunks: list[bytes] | None
    connection: int


async def _exchanges(transport: httpx.AsyncBaseTransport, app: Replica, url: str) -> list[Seen]:
    """The same requests, in the same order, through a client on ``transport``."""
    seen: list[Seen] = []
    ports: list[bytes] = []

    async def record(
        what: str, response: httpx.Response, chunks: list[bytes], *, paced: bool = False
    ) -> None:
        port = response.headers.get(PORT.decode(), "").encode()
        if port and port not in ports:
            ports.append(port)
        kept = [(n.lower(), v) for n, v in response.headers.raw if n.lower() not in UNCOMPARED]
        number = ports.index(port) if port else -1
        version, reason = response.http_version, response.reason_phrase
        body, paced_chunks = b"".join(chunks), chunks if paced else None
        seen.append(
            Seen(what, response.status_code, reason, version, kept, body, paced_chunks, number)
        )

    async def exchange(what: str, method: str, path: str, **options: Any) -> None:
        async with client.stream(method, path, **options) as response:
            chunks = [chunk async for chunk in response.aiter_raw()]
            await record(what, response, chunks)

    async with httpx.AsyncClient(transport=transport, base_url=url) as client:
        await exchange("json post", "POST", "/echo?q=1", json={"prompt": "hi", "n": [1, 2]})
        await exchange("doc", "GET", "/doc")
        await exchange("head", "HEAD", "/doc")
        await exchange("empty", "GET", "/empty")
        await exchange("404", "GET", "/missing")
        await exchange("503", "GET", "/busy")
        repeated = [("x-tag", "a"), ("x-tag", "b"), ("content-type", "application/octet-stream")]
        body = bytes(range(97, 123)) * 4000  # past one socket read
        await exchange("body", "PUT", "/echo", content=body, headers=repeated)
        async with client.stream("GET", "/stream") as response:
            chunks = []
            async for chunk in response.aiter_raw():
                chunks.append(chunk)
                app.acks.put(None)
            await record("stream", response, chunks, paced=True)
        async with client.stream("GET", "/hang") as response:
            async for chunk in response.aiter_raw():
                await record("closed early", response, [chunk])
                break
        for number in range(3):
            await exchange(f"again {number}", "GET", "/doc")
        with socket.socket() as refusing:
            refusing.bind(("127.0.0.1", 0))  # bound, not listening
            with pytest.raises(httpx.ConnectError):
                await client.get(f"http://127.0.0.1:{refusing.getsockname()[1]}/")
    return seen


def test_answers_equal_httpxs(replica: tuple[Replica, str]) -> None:
    """Statuses, reasons, headers, bytes and chunks alike; one connection kept alive through
    every answer read whole (HEAD, 204, 4xx and 5xx too), a new one after an answer closed
    before its end."""
    app, url = replica
    reference = asyncio.run(_exchanges(httpx.AsyncHTTPTransport(trust_env=False), app, url))
    copy = asyncio.run(_exchanges(_replica_transport(), app, url))
    for ours, theirs in zip(copy, reference, strict=True):
        assert ours == theirs
    what_to_seen = {s.what: s for s in copy}
    assert [s.connection for s in copy] == [0] * 9 + [1] * 3
    assert what_to_seen["stream"].chunks == [b"data: %d\n\n" % n for n in range(NUM_CHUNKS)]
    assert what_to_seen["head"].body == b"" and what_to_seen["empty"].body == b""
    assert (b"content-length", b"11") in what_to_seen["head"].headers
    assert (b"transfer-encoding", b"chunked") in what_to_seen["503"].headers
    echo = json.loads(what_to_seen["body"].body)
    assert [v for n, v in echo["headers"] if n == "x-tag"] == ["a", "b"]
    assert ["content-length", "104000"] in echo["headers"] and len(echo["body"]) == 104000
    assert [v for n, v in what_to_seen["body"].headers if n == b"x-echo"] == [b"one", b"two"]


def test_only_httpx_times_a_slow_answer_out(replica: tuple[Replica, str]) -> None:
    """The documented difference: the copy has no timeout past connecting (the forwarder
    bounds the waits on its loop), so a read timeout the client sets does not apply to it."""
    _, url = replica

    async def slow(transport: httpx.AsyncBaseTransport) -> bytes:
        timeout = httpx.Timeout(5.0, read=0.1)
        async with httpx.AsyncClient(transport=transport, base_url=url, timeout=timeout) as client:
            return (await client.get("/slow")).content

    with pytest.raises(httpx.ReadTimeout):
        asyncio.run(slow(httpx.AsyncHTTPTransport(trust_env=False)))
    assert asyncio.run(slow(_replica_transport())) == b"late"


def test_a_raw_answer_equals_httpxs_response(replica: tuple[Replica, str]) -> None:
    """A POST sent raw (the forwarder's way) and as an httpx request to the same route: the
    raw answer's status, header lines and body are httpx's response's (but Date, Server and
    the port), for a whole answer, a chunked one and an error."""
    _, url = replica
    body = b'{"prompt": "hi"}'
    heads = [("content-type", "application/json"), ("x-tag", "a")]

    async def both(path: str) -> None:
        transport = _replica_transport()
        target = httpx.URL(url + path)
        try:
            raw = await transport.send_raw(
                RawRequest(target, encoded_post(target, heads, body, "latin-1"), heads)
            )
            raw_body = b"".join([chunk async for chunk in raw.stream])
            await raw.aclose()
            request = httpx.Request("POST", target, content=body, headers=heads)
            response = await transport.handle_async_request(request)
            response_body = await response.aread()
            await response.aclose()
        finally:
            await transport.aclose()
        assert raw.status_code == response.status_code
        assert _compared(raw.raw_headers) == _compared(response.headers.raw)
        assert raw_body == response_body

    for path in ("/echo?q=1", "/busy", "/missing"):
        asyncio.run(both(path))


def _compared(headers: Headers) -> Headers:
    return [(n.lower(), v) for n, v in headers if n.lower() not in UNCOMPARED]
