"""The proxy's front protocol answers as uvicorn's cycle does: two real servers, one ASGI app.

One server runs the app's forwarded route on :class:`FrontProtocol`'s cycle, the other on
uvicorn's (the API's protocol, no hot routes); the same raw requests go to both and the
answers must agree: status line, headers but ``date``, the body (unchunked), the framing and
whether the connection stays open. The app tells which cycle ran it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.types import Receive, Scope, Send

from kvindex.api.http.background import BackgroundServer
from kvindex.api.http.server_protocol import ON_GONE, hot_protocol
from kvindex.clients.proxy.front_protocol import WHOLE_BODY, front_protocol

ROUTE = "/v1/chat/completions"
MAX_BODY = 4096


@dataclass
class Served:
    front: list[bool]
    """Per request of the route: whether the front cycle ran it."""
    gone: threading.Event
    taken: list[bool] = field(default_factory=list)
    """Per request of the route: whether its body was taken whole (:data:`WHOLE_BODY`)."""


async def _body(receive: Receive) -> bytes:
    chunks = []
    more = True
    while more:
        message = await receive()
        assert message["type"] == "http.request"
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


def _headers(what: bytes, length: int) -> list[tuple[bytes, bytes]]:
    headers = [(b"content-type", b"text/plain"), (b"x-what", what)]
    if what == b"close":
        headers.append((b"connection", b"close"))
    if what == b"smuggle":  # a line break in a header value: refused, 500
        headers.append((b"x-smuggled", b"a\r\nset-cookie: b"))
    if what != b"stream":
        headers.append((b"content-length", b"%d" % length))
    return headers


def _app(served: Served) -> Any:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        served.front.append(type(getattr(receive, "__self__", None)).__name__ == "_FrontCycle")
        take = scope["extensions"].get(WHOLE_BODY)
        taken = take() if take is not None and (b"x-take", b"1") in scope["headers"] else None
        served.taken.append(taken is not None)
        body = await _body(receive) if taken is None else taken
        what = body.split(b" ")[0]
        echo = b"%s %s %s" % (scope["method"].encode(), scope["raw_path"], body)
        if what == b"raise":
            raise RuntimeError("the endpoint failed")
        if what == b"gone":
            told = asyncio.Event()
            scope["extensions"][ON_GONE](told.set)
            await asyncio.wait_for(told.wait(), 5)
            served.gone.set()
            return
        headers = _headers(what, len(echo))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if what == b"stream":
            for part in (b"one ", b"", b"two ", echo):
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if what == b"late":
            await send({"type": "http.response.body", "body": echo[:3], "more_body": True})
            raise RuntimeError("the endpoint failed mid-answer")
        if what == b"short":
            return  # the head alone: an answer never finished
        await send({"type": "http.response.body", "body": echo, "more_body": False})

    return app


@pytest.fixture
def twins() -> Iterator[tuple[tuple[int, Served], tuple[int, Served]]]:
    with ExitStack() as stack:
        made = []
        for front in (True, False):
            served = Served([], threading.Event())
            app = _app(served)
            protocol = hot_protocol(5.0, None, linger_s=0.5)
            if front:
                protocol = front_protocol(protocol, {ROUTE: app}, MAX_BODY)
            server = stack.enter_context(BackgroundServer(app, http=protocol))
            made.append((server.port, served))
        yield made[0], made[1]


def _exchange(port: int, *parts: bytes, num_answers: int = 1) -> tuple[list[Any], bool]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        for i, part in enumerate(parts):
            if i:
                time.sleep(0.05)
            sock.sendall(part)
        reader = _Reader(sock)
        answers = [reader.answer() for _ in range(num_answers)]
        sock.settimeout(0.3)
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False
        except ConnectionResetError:
            closed = True
    return answers, closed


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            data = self.sock.recv(65536)
            if not data:
                return b""
            self.buffer += data
        part, self.buffer = self.buffer.split(marker, 1)
        return part

    def _take(self, length: int) -> bytes:
        while len(self.buffer) < length:
            data = self.sock.recv(65536)
            if not data:
                break
            self.buffer += data
        part, self.buffer = self.buffer[:length], self.buffer[length:]
        return part

    def answer(self) -> tuple[bytes, dict[bytes, bytes], bytes]:
        status_line, *lines = self._until(b"\r\n\r\n").split(b"\r\n")
        headers = dict(line.split(b": ", 1) for line in lines)
        headers.pop(b"date", None)
        if headers.get(b"transfer-encoding") == b"chunked":
            body = b""
            while size := int(self._until(b"\r\n") or b"0", 16):
                body += self._take(size)
                self._take(2)
            self._take(2)
        else:
            body = self._take(int(headers.get(b"content-length", b"0")))
        return status_line, headers, body


def _post(body: bytes, target: str = ROUTE, **headers: str) -> bytes:
    head = f"POST {target} HTTP/1.1\r\nhost: proxy.test\r\ncontent-length: {len(body)}\r\n"
    head += "".join(f"{name.replace('_', '-')}: {value}\r\n" for name, value in headers.items())
    return (head + "\r\n").encode() + body


CASES: list[tuple[bytes, ...]] = [
    (_post(b"length hello"),),
    (_post(b"stream hello"),),
    (_post(b"close hello"),),
    (_post(b"raise"),),
    (_post(b"smuggle"),),
    (_post(b"short"),),
    (_post(b"length split")[:-4], _post(b"length split")[-4:]),  # the body in two reads
    (_post(b"length head")[:20], _post(b"length head")[20:]),  # the head in two reads
]


def test_the_front_cycle_answers_as_uvicorns_does(twins: Any) -> None:
    (front, served), (plain, _) = twins
    for parts in CASES:
        mine, theirs = _exchange(front, *parts), _exchange(plain, *parts)
        assert mine == theirs, parts
    assert served.front == [True] * len(CASES)


def test_a_failure_mid_answer_closes_the_connection_as_uvicorn_does(twins: Any) -> None:
    (front, served), (plain, _) = twins
    wires = []
    for port in (front, plain):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(_post(b"late answer"))
            wire = b""
            while data := sock.recv(65536):
                wire += data
        wires.append(b"".join(line for line in wire.splitlines(True) if b"date: " not in line))
    assert wires[0] == wires[1]
    assert wires[0].startswith(b"HTTP/1.1 200 OK") and wires[0].endswith(b"\r\n\r\nPOS")
    assert served.front == [True]


def test_pipelined_requests_are_answered_in_order(twins: Any) -> None:
    (front, served), (plain, _) = twins
    parts = (_post(b"length first") + _post(b"stream second") + _post(b"length third"),)
    mine, theirs = _exchange(front, *parts, num_answers=3), _exchange(plain, *parts, num_answers=3)
    assert mine == theirs
    assert mine[0][0][2].endswith(b"first")
    assert served.front[0]


def test_a_body_taken_whole_answers_as_one_received(twins: Any) -> None:
    """The endpoint takes a body that has all come at once (no ``receive``); one still
    coming is read by ``receive``, as on uvicorn's cycle."""
    (front, served), (plain, _) = twins
    split = _post(b"length split", x_take="1")
    cases = [
        (_post(b"length hello", x_take="1"),),
        (_post(b"stream hello", x_take="1"),),
        (_post(b"close hello", x_take="1"),),
        (split[:-4], split[-4:]),
    ]
    for parts in cases:
        mine, theirs = _exchange(front, *parts), _exchange(plain, *parts)
        assert mine == theirs, parts
        assert mine[0][0][2].endswith(b"hello") or mine[0][0][2].endswith(b"split")
    assert served.front == [True] * len(cases)
    assert served.taken == [True, True, True, False]


def test_other_requests_go_to_uvicorns_cycle(twins: Any) -> None:
    (front, served), (plain, _) = twins
    chunked = (
        f"POST {ROUTE} HTTP/1.1\r\nhost: proxy.test\r\ntransfer-encoding: chunked\r\n\r\n"
        "6\r\nlength\r\n0\r\n\r\n"
    ).encode()
    others = [
        _post(b"length query", f"{ROUTE}?a=1"),
        _post(b"length big" + b"x" * MAX_BODY),
        chunked,
        _post(b"length old").replace(b"HTTP/1.1", b"HTTP/1.0"),
        _post(b"length continue", expect="100-continue"),
    ]
    for request in others:
        assert _exchange(front, request) == _exchange(plain, request), request
    assert served.front == [False] * len(others)


def test_a_client_gone_is_told(twins: Any) -> None:
    (front, served), _ = twins
    with socket.create_connection(("127.0.0.1", front), timeout=5) as sock:
        sock.sendall(_post(b"gone"))
        time.sleep(0.2)
    assert served.gone.wait(5)
    assert served.front == [True]
