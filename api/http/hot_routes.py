"""Reference: kvindex.api.http.app._score_routes; tests/integration/test_hot_routes.py::test_a_valid_score_request_gets_the_same_answer

``POST /score`` and ``GET /healthz`` answered in plain ASGI with the FastAPI route's answer
function, token check and error mapping; every other request goes on to FastAPI.
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvindex.indexer.domain.errors import KvIndexError

Answer = Callable[[bytes, Headers], Awaitable[bytes]]

MAPPED_ERRORS = (KvIndexError, msgspec.ValidationError, msgspec.DecodeError)
"""The errors the app's exception handlers map (others reach the server error middleware)."""
_JSON_HEAD = (b"content-type", b"application/json")


@dataclass(frozen=True, slots=True)
class RouteName:
    """A hot request's ``scope["route"]``: its template, where a router's route has it."""

    path: str


@dataclass(frozen=True, slots=True)
class HotRoute:
    method: str
    path: str
    route: Any
    """Set as ``scope["route"]``: an object whose ``path`` is the route's template."""
    answer: Answer
    guarded: bool
    reads_body: bool
    """False: the body is passed as ``b""`` unread."""
    bare: bool = False
    """Answered from its path alone (a ``GET``: no body, no header read, no token): a whole
    plain request for it may be answered before the parser sees it, with no headers."""
    constant: bytes | None = None
    """What ``answer`` always returns, if it never changes (a bare route's 200 is then
    written without calling it)."""


@dataclass(frozen=True, slots=True)
class HotServing:
    """What the server's protocol needs to answer the hot routes as the app would."""

    routes: dict[tuple[bytes, bytes], HotRoute]
    authorize: Callable[[Headers], None]
    error_response: Callable[[Exception], Response]
    observe: Callable[[Scope, int, float], None]
    max_body_bytes: int
    body_timeout_s: float
    bare: dict[bytes, HotRoute] = field(default_factory=dict)
    """The :attr:`HotRoute.bare` routes by path."""
    bare_heads: dict[bytes, HotRoute] = field(default_factory=dict)
    """Whole requests (their bytes) found to be plain ``GET`` s of a bare route: the server's
    protocol fills it, bounded."""

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
        bare = {r.path.encode(): r for r in routes if r.bare}
        assert all(r.method == "GET" and not (r.guarded or r.reads_body) for r in bare.values())
        return cls(table, authorize, error_response, observe, max_body_bytes, body_timeout_s, bare)


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
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
