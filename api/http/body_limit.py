"""A request body is bounded in size and in time: :class:`BodyLimit`, an ASGI middleware."""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvindex.indexer.domain.errors import KvIndexError


class BodyTooLargeError(KvIndexError):
    """A request body larger than ``api.max_body_bytes`` (declared or counted)."""


class BodyTimeoutError(KvIndexError):
    """A request body that did not arrive whole within ``api.body_timeout_s``."""


class BodyLimit:
    """ASGI middleware: bodies of at most ``max_bytes``, read within ``timeout_s``."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.app(scope, _LimitedBody(self, scope, receive), send)


class _LimitedBody:
    def __init__(self, limit: BodyLimit, scope: Scope, receive: Receive) -> None:
        self.limit = limit
        self.receive = receive
        self.scope = scope
        self.num_bytes = 0
        self.deadline: float | None = None

    async def __call__(self) -> Message:
        max_bytes = self.limit.max_bytes
        if self.deadline is None:
            self.deadline = asyncio.get_running_loop().time() + self.limit.timeout_s
            declared = _content_length(self.scope)
            if declared is not None and declared > max_bytes:
                raise BodyTooLargeError(_too_large(f"Content-Length {declared}", max_bytes))
        try:
            async with asyncio.timeout_at(self.deadline):
                message = await self.receive()
        except TimeoutError:
            raise body_timeout_error(self.limit.timeout_s) from None
        if message["type"] == "http.request":
            self.num_bytes += len(message.get("body", b""))
            if self.num_bytes > max_bytes:
                raise BodyTooLargeError(_too_large(f"{self.num_bytes} bytes", max_bytes))
        return message


def body_timeout_error(timeout_s: float) -> BodyTimeoutError:
    return BodyTimeoutError(f"request body not received within {timeout_s} s (api.body_timeout_s)")


def _too_large(what: str, max_bytes: int) -> str:
    return f"request body too large: {what}, the limit is {max_bytes} (api.max_body_bytes)"


def _content_length(scope: Scope) -> int | None:
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
