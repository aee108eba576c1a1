"""The proxy's routes, built by :func:`create_proxy_app` from explicit parts (no module state).

* ``POST /v1/chat/completions`` and ``POST /v1/completions``: body read (at most
  ``api.max_body_bytes``: 413 past it, 408 when it is not received within
  ``api.body_timeout_s``), replicas chosen (:mod:`.upstream`), the request forwarded and
  its answer streamed back (:mod:`.forwarding`).
* ``GET /v1/models``: the models the fleet serves, in OpenAI's list shape.
* ``GET /health`` and ``/healthz``: the process is up; ``/readyz``: the index store is
  reachable; ``/metrics``: :mod:`.metrics`.

Errors the proxy makes itself are answered in one place (:func:`_error_response`), in
OpenAI's error shape ``{"error": {"message", "type", "code"}}``; a replica's own error
answer is passed on untouched.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvindex.api.body_limit import BodyTimeoutError, BodyTooLargeError
from kvindex.api.score import RequestError, UnknownModelError
from kvindex.api.settings import ApiSettings
from kvindex.clients.proxy.forwarding import (
    REQUEST_ID,
    Forwarder,
    StreamedAnswer,
    UpstreamFailedError,
    UpstreamTimeoutError,
    forwarded_headers,
    request_id_of,
)
from kvindex.clients.proxy.metrics import NO_REPLICA, ProxyMetrics
from kvindex.clients.proxy.upstream import BadRequestBodyError, NoUpstreamError, UpstreamPicker
from kvindex.indexer.fleet.registry import RegistryView
from kvindex.indexer.index.protocol import BlockIndex, IndexUnavailableError

_JSON = "application/json"
_METRICS = "text/plain; version=0.0.4; charset=utf-8"
FORWARDED_ROUTES = ("/v1/chat/completions", "/v1/completions")


@dataclass
class ProxyParts:
    """What the app is built from; the caller owns them all (and closes the forwarder)."""

    api: ApiSettings
    registry: RegistryView
    index: BlockIndex
    picker: UpstreamPicker
    forwarder: Forwarder
    metrics: ProxyMetrics
    blocking_store: bool
    """True when index calls do network I/O (Redis): run them off the loop."""


def create_proxy_app(
    parts: ProxyParts, lifespan: Callable[[Starlette], Any] | None = None
) -> Starlette:
    routes = [Route(path, _forwarded(parts, path), methods=["POST"]) for path in FORWARDED_ROUTES]
    routes += [
        Route("/v1/models", _models(parts), methods=["GET"]),
        Route("/health", _ok, methods=["GET"]),
        Route("/healthz", _ok, methods=["GET"]),
        Route("/readyz", _ready(parts), methods=["GET"]),
        Route("/metrics", _metrics(parts), methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


_STATUS_OF: tuple[tuple[tuple[type[BaseException], ...], int, str], ...] = (
    ((BadRequestBodyError, msgspec.DecodeError), 400, "invalid_request_error"),
    ((RequestError,), 400, "invalid_request_error"),
    ((UnknownModelError,), 404, "model_not_found"),
    ((BodyTimeoutError,), 408, "request_timeout"),
    ((BodyTooLargeError,), 413, "request_too_large"),
    ((UpstreamFailedError,), 502, "upstream_failed"),
    ((NoUpstreamError,), 503, "no_upstream"),
    ((UpstreamTimeoutError,), 504, "upstream_timeout"),
)


def _error_response(exc: Exception, request_id: str) -> Response:
    """The one place the proxy's own errors become HTTP answers (others: 500)."""
    status, kind = 500, "internal_error"
    for kinds, code, name in _STATUS_OF:
        if isinstance(exc, kinds):
            status, kind = code, name
            break
    body = {"error": {"message": str(exc), "type": kind, "code": status}}
    headers = {REQUEST_ID: request_id}
    if status in (408, 413):  # the rest of the body is not read: end the connection
        headers["connection"] = "close"
    return Response(msgspec.json.encode(body), status, headers=headers, media_type=_JSON)


class _Forwarded:
    """The ASGI endpoint of one forwarded route (see the module docstring)."""

    def __init__(self, parts: ProxyParts, path: str) -> None:
        self.parts = parts
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        request = Request(scope, receive)
        headers = request.headers.items()
        request_id = request_id_of(headers)
        try:
            answer = await self._answer(request, headers, request_id, started)
        except Exception as exc:
            response = _error_response(exc, request_id)
            self._count(response.status_code, NO_REPLICA, started)
            await response(scope, receive, send)
            return
        await answer(scope, receive, send)

    async def _answer(
        self, request: Request, headers: list[tuple[str, str]], request_id: str, started: float
    ) -> StreamedAnswer:
        parts = self.parts
        deadline = parts.forwarder.deadline()
        body = await _body(request, parts.api)
        decoded = msgspec.json.decode(body)
        if not isinstance(decoded, dict):
            raise BadRequestBodyError("the body must be a JSON object")
        choice = await parts.picker.choose(decoded, dict(headers))
        if choice.matched_fraction is not None:
            parts.metrics.matched_fraction.observe(choice.matched_fraction)
        upstream_headers = forwarded_headers(headers, request_id)
        opened = await parts.forwarder.open(
            self.path, body, upstream_headers, choice.upstreams, deadline
        )
        parts.metrics.first_byte.labels(self.path).observe(time.perf_counter() - started)
        return StreamedAnswer(
            opened, request_id, deadline, lambda status, r: self._count(status, r, started)
        )

    def _count(self, status: int, replica: str, started: float) -> None:
        metrics = self.parts.metrics
        metrics.requests.labels(self.path, str(status), replica).inc()
        metrics.duration.labels(self.path).observe(time.perf_counter() - started)


def _forwarded(parts: ProxyParts, path: str) -> Any:
    return _Forwarded(parts, path)


async def _body(request: Request, api: ApiSettings) -> bytes:
    """The whole body, at most ``api.max_body_bytes``, within ``api.body_timeout_s``."""
    declared = request.headers.get("content-length")
    limit = api.max_body_bytes
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLargeError(f"request body too large: Content-Length {declared}, limit {limit}")
    chunks: list[bytes] = []
    num_bytes = 0
    try:
        async with asyncio.timeout(api.body_timeout_s):
            async for chunk in request.stream():
                num_bytes += len(chunk)
                if num_bytes > limit:
                    raise BodyTooLargeError(f"request body too large: over {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeoutError(f"request body not received within {api.body_timeout_s} s") from None
    except ClientDisconnect:
        raise BodyTimeoutError("the client went away before sending its body") from None
    return b"".join(chunks)


def _json(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status, media_type=_JSON)


async def _ok(_: Request) -> Response:
    return _json({"status": "ok"})


def _models(parts: ProxyParts) -> Callable[[Request], Awaitable[Response]]:
    async def models(_: Request) -> Response:
        names = await _call(parts, parts.registry.models)
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "kvindex"} for m in names]
        return _json({"object": "list", "data": data})

    return models


def _ready(parts: ProxyParts) -> Callable[[Request], Awaitable[Response]]:
    async def ready(_: Request) -> Response:
        try:
            await _call(parts, parts.index.streams)
        except IndexUnavailableError as exc:
            return _json({"status": "unavailable", "detail": str(exc)}, 503)
        return _json({"status": "ready"})

    return ready


def _metrics(parts: ProxyParts) -> Callable[[Request], Awaitable[Response]]:
    async def metrics(_: Request) -> Response:
        return Response(parts.metrics.render(), media_type=_METRICS)

    return metrics


async def _call(parts: ProxyParts, fn: Callable[[], Any]) -> Any:
    """Run a store call off the event loop when it does network I/O."""
    if parts.blocking_store:
        return await asyncio.to_thread(fn)
    return fn()
