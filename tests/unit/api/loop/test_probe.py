"""kvindex.api.loop.probe: GETs against loopback servers that answer well, badly or not at all,
held equal to httpx's answers (the reference) where the answer is sound."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from kvindex.api.loop.probe import Answer, Probes

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK_BODY = b"vllm:num_requests_running 1.0\n"


def _answer(raw: bytes) -> Handler:
    """A server that reads each request's head and writes ``raw``, while the client stays."""

    async def reply(_head: bytes, _reader: asyncio.StreamReader) -> bytes:
        return raw

    return _each_request(reply)


def _each_request(reply: Callable[[bytes, asyncio.StreamReader], Awaitable[bytes]]) -> Handler:
    """A server that reads each request's head and writes what ``reply`` makes of it (the
    reader given to read a body), while the client stays."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                writer.write(await reply(head, reader))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return handle


def _once_then(raw: bytes, then: Callable[[asyncio.StreamWriter], Awaitable[None]]) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(raw)
            await writer.drain()
            await then(writer)
        except ConnectionError:
            pass
        finally:
            writer.close()

    return handle


@asynccontextmanager
async def _server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """The server's base URL and the number of connections it accepted (a one-item list)."""
    accepted = [0]

    async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        await handler(reader, writer)

    server = await asyncio.start_server(counted, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        server.close()


async def _get(probes: Probes, url: str, timeout: float = 0.5) -> Answer:
    return await probes.get(url, timeout=timeout)


SOUND = {
    "length": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(OK_BODY), OK_BODY),
    "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "error": b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy",
    "empty": b"HTTP/1.1 204 No Content\r\n\r\n",
    "interim": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "latin": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n\xff\xfe",
}


@pytest.mark.parametrize("name", sorted(SOUND))
def test_as_httpx(name: str) -> None:
    async def main() -> None:
        async with _server(_answer(SOUND[name])) as (url, _), httpx.AsyncClient() as client:
            probes = Probes(client)
            for _ in range(2):  # the second on the kept-alive connection
                mine = await _get(probes, url + "/metrics")
                theirs = await client.get(url + "/metrics", timeout=0.5)
                assert (mine.status_code, mine.is_success) == (
                    theirs.status_code,
                    theirs.is_success,
                )
                assert mine.text == theirs.text
            await probes.aclose()

    asyncio.run(main())


def _echo(received: list[tuple[bytes, bytes]]) -> Handler:
    """A server that reads each request (its head, then ``Content-Length`` bytes), keeps
    (head, body) and answers with the body, upper-cased."""

    async def reply(head: bytes, reader: asyncio.StreamReader) -> bytes:
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.lower().split(b"\r\n")
            if line.startswith(b"content-length:")
        )
        body = await reader.readexactly(length)
        received.append((head, body))
        answer = body.upper()
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(answer), answer)

    return _each_request(reply)


def test_a_post_as_httpx() -> None:
    """The same answer as httpx's POST, on one kept-alive connection; the request a JSON POST
    of the body to the path."""

    async def main() -> None:
        received: list[tuple[bytes, bytes]] = []
        async with _server(_echo(received)) as (url, accepted), httpx.AsyncClient() as client:
            probes = Probes(client)
            for body in (b'{"prompt": "a"}', b"{}", '{"é": 1}'.encode() * 5000):
                mine = await probes.post(url + "/v1/completions/render", body, timeout=0.5)
                headers = {"content-type": "application/json"}
                theirs = await client.post(
                    url + "/v1/completions/render", content=body, headers=headers, timeout=0.5
                )
                assert (mine.status_code, mine.content) == (theirs.status_code, theirs.content)
                assert mine.content == body.upper()
            await probes.aclose()
        heads = [head for head, _ in received[::2]]
        assert all(h.startswith(b"POST /v1/completions/render HTTP/1.1\r\n") for h in heads)
        assert all(b"content-type: application/json" in h.lower() for h in heads)
        assert accepted == [2]  # one connection each: Probes' and httpx's

    asyncio.run(main())


def test_a_body_until_close_is_read_to_the_close() -> None:
    async def close(_writer: asyncio.StreamWriter) -> None:
        return None

    async def main() -> None:
        raw = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it"
        async with _server(_once_then(raw, close)) as (url, _), httpx.AsyncClient() as client:
            answer = await _get(Probes(client), url)
            assert (answer.status_code, answer.text) == (200, "all of it")

    asyncio.run(main())


def test_one_connection_serves_every_get_and_a_closed_idle_one_is_replaced() -> None:
    async def main() -> None:
        raw = SOUND["length"]
        async with _server(_answer(raw)) as (url, accepted), httpx.AsyncClient() as client:
            probes = Probes(client)
            for _ in range(5):
                assert (await _get(probes, url + "/health")).status_code == 200
            assert accepted == [1]
            await probes.aclose()

        async def closed(_writer: asyncio.StreamWriter) -> None:
            return None  # the server closes the connection once it has answered

        async with _server(_once_then(raw, closed)) as (url, accepted), httpx.AsyncClient() as c:
            probes = Probes(c)
            for _ in range(3):
                assert (await _get(probes, url)).status_code == 200
            assert accepted == [3]

    asyncio.run(main())


async def _error(handler: Handler, *, timeout: float = 0.5, max_body: int = 1 << 20) -> Exception:
    async with _server(handler) as (url, _), httpx.AsyncClient() as client:
        probes = Probes(client, max_body_bytes=max_body)
        with pytest.raises(Exception) as caught:
            await probes.get(url + "/health", timeout=timeout)
        await probes.aclose()
        assert isinstance(caught.value, Exception)
        return caught.value


def test_garbage_is_a_protocol_error() -> None:
    error = asyncio.run(_error(_answer(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")))
    assert type(error) is httpx.RemoteProtocolError and "malformed answer" in str(error)


def test_a_connection_closed_mid_answer_is_a_protocol_error() -> None:
    async def close(_writer: asyncio.StreamWriter) -> None:
        return None

    half = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part"
    error = asyncio.run(_error(_once_then(half, close)))
    assert type(error) is httpx.RemoteProtocolError and "before the answer's end" in str(error)


def test_a_connection_closed_before_any_byte_is_a_protocol_error() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    error = asyncio.run(_error(handle))
    assert type(error) is httpx.RemoteProtocolError and "before any byte" in str(error)


def test_a_trickle_is_cut_by_the_one_deadline() -> None:
    async def trickle(writer: asyncio.StreamWriter) -> None:
        for _ in range(100):
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.02)

    head = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"

    async def main() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        error = await _error(_once_then(head, trickle), timeout=0.3)
        assert isinstance(error, TimeoutError)
        return loop.time() - start

    assert asyncio.run(main()) < 1.0


def test_an_endless_body_stops_at_the_bound() -> None:
    async def endless(writer: asyncio.StreamWriter) -> None:
        for _ in range(1000):
            writer.write(b"x" * 4096)
            await writer.drain()

    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunky = _once_then(head, lambda w: endless(_Chunks(w)))  # type: ignore[arg-type]
    error = asyncio.run(_error(chunky, timeout=5.0, max_body=64 * 1024))
    assert type(error) is httpx.RemoteProtocolError and "over 65536 bytes" in str(error)


class _Chunks:
    """A writer that frames each write as one chunk."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    def write(self, data: bytes) -> None:
        self._writer.write(b"%x\r\n%s\r\n" % (len(data), data))

    async def drain(self) -> None:
        await self._writer.drain()


def test_a_silent_server_times_out_and_a_refused_port_is_a_connect_error() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.read(4096):  # never answers; done when the client closes
                pass
        finally:
            writer.close()

    assert isinstance(asyncio.run(_error(silent, timeout=0.2)), TimeoutError)

    async def refused() -> None:
        async with _server(_answer(b"")) as (url, _):
            pass  # closed: its port now refuses
        async with httpx.AsyncClient() as client:
            with pytest.raises(httpx.ConnectError):
                await Probes(client).get(url, timeout=0.5)

    asyncio.run(refused())


def test_other_urls_go_to_the_fallback_client() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, text="tls")

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            probes = Probes(client)
            assert (await probes.get("https://r:8443/health", timeout=0.5)).text == "tls"
            await probes.get("http://user:pw@r/health", timeout=0.5)
            answer = await probes.post("https://r:8443/tokenize", b"{}", timeout=0.5)
            assert answer.content == b"tls"

    asyncio.run(main())
    assert seen == ["https://r:8443/health", "http://user:pw@r/health", "https://r:8443/tokenize"]


def test_bytes_past_the_answer_close_the_connection_and_the_answer_stands() -> None:
    async def main() -> None:
        raw = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokJUNK\r\n\r\n"
        async with _server(_answer(raw)) as (url, accepted), httpx.AsyncClient() as client:
            probes = Probes(client)
            for _ in range(2):
                answer = await _get(probes, url)
                assert (answer.status_code, answer.text) == (200, "ok")
            assert accepted == [2]  # the first connection was not reused
            await probes.aclose()

    asyncio.run(main())
