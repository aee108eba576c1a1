"""Reference: kvindex.api.http.app._score_routes; tests/integration/test_hot_routes.py::test_a_valid_score_request_gets_the_same_answer

The hot routes (``POST /score``, ``GET /healthz``) answered in plain ASGI by the innermost
middleware, :class:`HotRoutes`, with FastAPI's route's answer function, token check and
error mapping; every other request goes on to FastAPI. :class:`HotServing` hands the same
routes to the server's protocol (:mod:`kvindex.api.http.server_protocol`).
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvindex.indexer.domain.errors import KvIndexError

Answer = Callable[[bytes, Headers], Awaitable[bytes]]
"""A request's body and headers → the encoded JSON answer (raises what the app maps)."""

MAPPED_ERRORS = (KvIndexError, msgspec.ValidationError, msgspec.DecodeError)
"""The errors the app's exception handlers map (others reach the server error middleware)."""
_JSON_HEAD = (b"content-type", b"application/json")


@dataclass(frozen=True, slots=True)
class HotRoute:
    """One route answered in plain ASGI (status 200 with a JSON body, or a mapped error)."""

    method: str
    path: str
    route: Any
    """The FastAPI route of the same method and path, stored as ``scope["route"]`` as the
    router would (the traffic observer labels by its template)."""
    answer: Answer
    guarded: bool
    """The bearer-token check runs first (as the route's dependency does)."""
    reads_body: bool
    """The body is read (and bounded by the body limit); False: passed as ``b""`` unread."""


@dataclass(frozen=True, slots=True)
class HotServing:
    """What a server needs to answer the hot routes itself, as the app would
    (:mod:`kvindex.api.http.server_protocol`): the same routes, token check and error mapping,
    the traffic observer's count, the body limit's bounds."""

    routes: dict[tuple[bytes, bytes], HotRoute]
    """(method, path) as they come in the request line → the route."""
    authorize: Callable[[Headers], None]
    error_response: Callable[[Exception], Response]
    observe: Callable[[Scope, int, float], None]
    """Counts an answered request (scope with its ``route``, status, seconds)."""
    max_body_bytes: int
    body_timeout_s: float

    @classmethod
    def build(
        cls,
        routes: Sequence[HotRoute],
        *,
        authorize: Callable[[Headers], None],
        error_response: Callable[[Exception], Response],
        observe: Callable[[Scope, int, float], None],
        max_body_bytes: int,
        body_timeout_s: float,
    ) -> HotServing:
        table = {(r.method.encode(), r.path.encode()): r for r in routes}
        return cls(table, authorize, error_response, observe, max_body_bytes, body_timeout_s)


class HotRoutes:
    """ASGI middleware: the requests of ``routes`` answered here, everything else by ``app``."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        routes: Sequence[HotRoute],
        authorize: Callable[[Headers], None],
        error_response: Callable[[Exception], Response],
    ) -> None:
        self.app = app
        self.routes = {(r.method, r.path): r for r in routes}
        self.authorize = authorize
        self.error_response = error_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hot = self.routes.get((scope["method"], scope["path"])) if scope["type"] == "http" else None
        if hot is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = hot.route
        try:
            headers = Headers(scope=scope)
            if hot.guarded:
                self.authorize(headers)
            body = await hot.answer(await _body(receive) if hot.reads_body else b"", headers)
        except MAPPED_ERRORS as exc:
            await self.error_response(exc)(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", str(len(body)).encode()), _JSON_HEAD],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def _body(receive: Receive) -> bytes:
    """The whole request body (as ``Request.body()`` reads it)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
