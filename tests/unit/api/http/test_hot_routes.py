"""HotRoutes alone, around a recording ASGI app: what it answers, what it passes on, what it
raises (the answers' agreement with FastAPI's routes is tests/integration/test_hot_routes.py)."""

from __future__ import annotations

import asyncio

import pytest
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from kvindex.api.http.hot_routes import HotRoute, HotRoutes
from kvindex.indexer.domain.errors import KvIndexError


class RefusedError(KvIndexError):
    pass


class Downstream:
    """The app behind: records the scopes it was given, answers 404."""

    def __init__(self) -> None:
        self.scopes: list[Scope] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scopes.append(scope)
        if scope["type"] == "http":
            await Response(b"not here", 404)(scope, receive, send)


async def echo(body: bytes, headers: Headers) -> bytes:
    if headers.get("x-fail") == "mapped":
        raise RefusedError("refused")
    if headers.get("x-fail") == "other":
        raise RuntimeError("a bug")
    return b'{"echo":' + (body or b"null") + b"}"


def check_token(headers: Headers) -> None:
    if headers.get("authorization") != "Bearer t":
        raise RefusedError("no token")


def error_response(exc: Exception) -> Response:
    return Response(f"mapped: {exc}".encode(), 418)


def hot_routes(downstream: Downstream) -> HotRoutes:
    routes = [
        HotRoute("POST", "/echo", "echo-route", echo, guarded=True, reads_body=True),
        HotRoute("GET", "/ping", "ping-route", echo, guarded=False, reads_body=False),
    ]
    return HotRoutes(
        downstream, routes=routes, authorize=check_token, error_response=error_response
    )


def call(
    app: HotRoutes,
    method: str,
    path: str,
    chunks: list[bytes],
    headers: dict[str, str] | None = None,
) -> tuple[Scope, list[Message], int]:
    """One request; returns its scope, what was sent and how many messages were received."""
    raw = [
        (k.encode(), v.encode())
        for k, v in (headers if headers is not None else {"authorization": "Bearer t"}).items()
    ]
    scope: Scope = {"type": "http", "method": method, "path": path, "headers": raw}
    incoming: list[Message] = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    incoming.append({"type": "http.disconnect"})
    sent: list[Message] = []
    num_received = 0

    async def receive() -> Message:
        nonlocal num_received
        num_received += 1
        return incoming.pop(0)

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return scope, sent, num_received


async def _never() -> Message:
    raise AssertionError("not to be received")


async def _discard(_message: Message) -> None:
    pass


def test_a_hot_request_is_answered_with_its_route_in_the_scope() -> None:
    downstream = Downstream()
    scope, sent, _ = call(hot_routes(downstream), "POST", "/echo", [b"[1,", b"2]"])
    assert downstream.scopes == []
    assert scope["route"] == "echo-route"
    assert sent[0]["status"] == 200
    assert dict(sent[0]["headers"]) == {
        b"content-length": b"14",
        b"content-type": b"application/json",
    }
    assert sent[1]["body"] == b'{"echo":[1,2]}'


def test_other_methods_paths_and_scopes_go_to_the_app() -> None:
    downstream = Downstream()
    app = hot_routes(downstream)
    for method, path in [("GET", "/echo"), ("POST", "/echo/"), ("POST", "/ping")]:
        _, sent, _ = call(app, method, path, [b""])
        assert sent[0]["status"] == 404
    asyncio.run(app({"type": "lifespan"}, _never, _discard))  # no method, no path: passed on
    assert [s.get("method") for s in downstream.scopes] == ["GET", "POST", "POST", None]
    assert all("route" not in s for s in downstream.scopes)


def test_a_route_that_reads_no_body_never_receives() -> None:
    _, sent, num_received = call(hot_routes(Downstream()), "GET", "/ping", [b"ignored"], {})
    assert num_received == 0
    assert sent[1]["body"] == b'{"echo":null}'


def test_the_token_is_checked_before_the_body_is_read() -> None:
    _, sent, num_received = call(hot_routes(Downstream()), "POST", "/echo", [b"1"], {})
    assert num_received == 0
    assert (sent[0]["status"], sent[1]["body"]) == (418, b"mapped: no token")


def test_a_mapped_error_is_answered_and_another_is_raised() -> None:
    app = hot_routes(Downstream())
    mapped = {"authorization": "Bearer t", "x-fail": "mapped"}
    _, sent, _ = call(app, "POST", "/echo", [b"1"], mapped)
    assert (sent[0]["status"], sent[1]["body"]) == (418, b"mapped: refused")
    with pytest.raises(RuntimeError, match="a bug"):
        call(app, "POST", "/echo", [b"1"], {"authorization": "Bearer t", "x-fail": "other"})


def test_a_client_gone_before_its_body_is_a_disconnect() -> None:
    with pytest.raises(ClientDisconnect):
        call(hot_routes(Downstream()), "POST", "/echo", [])
