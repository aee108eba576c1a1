"""The proxy's routes, built by :func:`create_proxy_app` from explicit parts (no module state)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kvindex.api.config.settings import ApiSettings
from kvindex.api.health.block_sizes import BlockSizeCheck
from kvindex.api.health.routing import health_policy
from kvindex.api.http.body_limit import BodyTimeoutError, BodyTooLargeError
from kvindex.api.http.views import replica_views, stats_view
from kvindex.api.http.worker_scrape import WorkerScrape
from kvindex.api.load.desk import Dispatch
from kvindex.api.load.store import LoadStore
from kvindex.api.loop.off_loop import OffLoop
from kvindex.api.score import RequestError, UnknownModelError
from kvindex.api.tokenize.protocol import Tokenizer
from kvindex.clients.proxy.access_log import Exchange, log_exchange
from kvindex.clients.proxy.auth import InboundAuth, UnauthorizedError
from kvindex.clients.proxy.decisions import (
    BadDecisionQueryError,
    UnknownDecisionError,
    decision,
    decisions,
)
from kvindex.clients.proxy.forwarding import (
    ClientGoneError,
    Forwarder,
    StreamedAnswer,
    UpstreamFailedError,
    UpstreamTimeoutError,
    on_gone_of,
)
from kvindex.clients.proxy.front_protocol import WHOLE_BODY
from kvindex.clients.proxy.headers import (
    REQUEST_ID,
    BadHeaderError,
    forwarded_headers,
    request_id_of,
)
from kvindex.clients.proxy.journal import Journal, ReceiptSink, Ticket
from kvindex.clients.proxy.metrics import NO_REPLICA, ProxyMetrics
from kvindex.clients.proxy.owed_tokens import OwedTokens
from kvindex.clients.proxy.predictions import (
    Accuracy,
    AnswerTruth,
    BodyTruth,
    Prediction,
    Predictions,
    StreamTruth,
    Truth,
    with_usage_asked,
)
from kvindex.clients.proxy.routes import (
    PASSTHROUGH_ROUTES,
    UnknownRouteError,
    escapes,
    normal_path,
)
from kvindex.clients.proxy.settings import ProxySettings
from kvindex.clients.proxy.untokenized import UNTOKENIZED
from kvindex.clients.proxy.upstream import (
    SESSION_HEADER,
    BadRequestBodyError,
    Choice,
    NoUpstreamError,
    UpstreamPicker,
    decoded_body,
)
from kvindex.clients.proxy.verdicts import Verdicts, verdicts_of
from kvindex.indexer.fleet.registry import RegistryView
from kvindex.indexer.index.protocol import BlockIndex, IndexUnavailableError

logger = logging.getLogger("kvindex.proxy")
_JSON = "application/json"
_METRICS = "text/plain; version=0.0.4; charset=utf-8"
FORWARDED_ROUTES = ("/v1/chat/completions", "/v1/completions")
PASSTHROUGH_ROUTE = "/v1/{path:path}"
PASSTHROUGH_LABEL = "/v1/{path}"
"""The ``route`` label of every passed-through request (one series, whatever the path)."""
PASSTHROUGH_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


@dataclass
class ProxyParts:
    """What the app is built from; the caller owns them all (and closes the forwarder)."""

    api: ApiSettings
    registry: RegistryView
    index: BlockIndex
    picker: UpstreamPicker
    forwarder: Forwarder
    metrics: ProxyMetrics
    off_loop: OffLoop
    """Runs the index and fleet reads (off the loop when they do network I/O)."""
    proxy: ProxySettings = field(default_factory=ProxySettings)
    loads: LoadStore | None = None
    """With ``block_sizes``: ``GET /replicas`` and ``GET /stats`` are served (as the API's)."""
    block_sizes: BlockSizeCheck | None = None
    scrape: WorkerScrape | None = None
    """With ``--workers N``: ``/metrics`` shows every worker's series."""
    auth: InboundAuth = field(init=False)
    """The bearer-token check of ``proxy.auth_token``."""
    predictions: Predictions = field(init=False)
    """Each routed request's prediction against the engine's answer, counted per replica."""
    verdicts: Verdicts = field(init=False)
    receipts: ReceiptSink | None = None
    """Where the journal's receipts are shared (the Redis store's Stream; None: memory only)."""
    tokenizers: Callable[[str], Tokenizer | None] = lambda _model: None
    """The read path's tokenizers (receipts keeping token ids tokenize with them)."""
    journal: Journal = field(init=False)
    """Every routed request's receipt (explained when the picker explains)."""

    def __post_init__(self) -> None:
        self.auth = InboundAuth(self.proxy.auth_token)
        self.verdicts = verdicts_of(self.proxy, self.registry, self.metrics)
        self.predictions = Predictions(self.metrics.observe_prediction, self.verdicts.judge)
        self.journal = Journal(
            self.proxy,
            sink=self.receipts,
            tokenizers=self.tokenizers,
            on_dropped=self.metrics.receipt_write_failures.inc,
        )


class _ProxyApp(Starlette):
    """Starlette, but a ``POST`` to an exact path of ``hot`` goes straight to its endpoint
    (middleware and router add nothing there); any other path is routed in its normal form
    (:mod:`.routes`), or refused with 404 when that leaves ``/v1/``."""

    def __init__(
        self, hot: Mapping[str, ASGIApp], auth: InboundAuth | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self._hot = hot
        self._auth = auth or InboundAuth(None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            endpoint = self._hot.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self
                await endpoint(scope, receive, send)
                return
        if scope["type"] == "http":
            path = scope["path"]
            normal = normal_path(path)
            try:  # before routing: no 404, 405 or redirect tells who lacks the token a thing
                self._auth.check(normal, Headers(scope=scope))
            except UnauthorizedError as exc:
                await _error_response(exc, request_id_of(_headers(scope)))(scope, receive, send)
                return
            if escapes(path, normal):
                refused = UnknownRouteError(f"no such route: {path!r} leaves /v1/")
                await _error_response(refused, request_id_of(_headers(scope)))(scope, receive, send)
                return
            if normal != path:
                scope = {**scope, "path": normal, "raw_path": normal.encode()}
        await super().__call__(scope, receive, send)


def forwarded_endpoints(app: Starlette) -> Mapping[str, ASGIApp]:
    """The forwarded routes' endpoints of a proxy app, by exact path (none: another app)."""
    return app._hot if isinstance(app, _ProxyApp) else {}


def _headers(scope: Scope) -> list[tuple[str, str]]:
    return [(n.decode("latin-1"), v.decode("latin-1")) for n, v in scope["headers"]]


def create_proxy_app(
    parts: ProxyParts, lifespan: Callable[[Starlette], Any] | None = None
) -> Starlette:
    hot = {path: _Forwarded(parts, path) for path in FORWARDED_ROUTES}
    routes = [Route(path, hot[path], methods=["POST"]) for path in FORWARDED_ROUTES]
    routes += [
        Route("/v1/models", _guarded(parts, _models(parts)), methods=["GET"]),
        Route("/health", _ok, methods=["GET"]),
        Route("/healthz", _ok, methods=["GET"]),
        Route("/readyz", _ready(parts), methods=["GET"]),
        Route("/metrics", _guarded(parts, _metrics(parts)), methods=["GET"]),
        Route("/decisions", _guarded(parts, decisions(parts.journal)), methods=["GET"]),
        Route("/decisions/{request_id}", _guarded(parts, decision(parts.journal)), methods=["GET"]),
        *_fleet_routes(parts),
        Route(
            PASSTHROUGH_ROUTE,
            _Forwarded(parts, PASSTHROUGH_LABEL, passthrough=True),
            methods=PASSTHROUGH_METHODS,
        ),
    ]
    outside = [r for r in parts.proxy.extra_routes if not r.startswith("/v1/")]  # /tokenize
    passed = _Forwarded(parts, PASSTHROUGH_LABEL, passthrough=True)
    routes += [Route(r, passed, methods=PASSTHROUGH_METHODS) for r in outside]
    handlers = {HTTPException: _router_error}
    return _ProxyApp(
        hot, auth=parts.auth, routes=routes, lifespan=lifespan, exception_handlers=handlers
    )


async def _router_error(request: Request, exc: Exception) -> Response:
    """The router's own 404 and 405, in OpenAI's shape like every other error."""
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
    request_id = request_id_of(request.headers.items())
    body = _error_body(exc.detail, kind, exc.status_code, request_id)
    headers = {**(exc.headers or {}), REQUEST_ID: request_id}
    return Response(msgspec.json.encode(body), exc.status_code, headers, media_type=_JSON)


_STATUS_OF: tuple[tuple[tuple[type[BaseException], ...], int, str], ...] = (
    ((BadRequestBodyError, BadHeaderError, msgspec.DecodeError), 400, "invalid_request_error"),
    ((UnauthorizedError,), 401, "unauthorized"),
    ((RequestError, BadDecisionQueryError), 400, "invalid_request_error"),
    ((UnknownModelError,), 404, "model_not_found"),
    ((UnknownRouteError, UnknownDecisionError), 404, "not_found"),
    ((BodyTimeoutError,), 408, "request_timeout"),
    ((BodyTooLargeError,), 413, "request_too_large"),
    ((ClientGoneError,), 499, "client_closed_request"),
    ((UpstreamFailedError,), 502, "upstream_failed"),
    ((NoUpstreamError,), 503, "no_upstream"),
    ((UpstreamTimeoutError,), 504, "upstream_timeout"),
)


_SERVER_SIDE = {
    500: "internal error",
    502: "no replica could answer the request",
    503: "no replica can take the request now",
    504: "no replica answered in time",
}
"""A 5xx body's message: what went wrong on the replicas' side is for the log, not the client."""


def _error_response(exc: Exception, request_id: str, *, route: str | None = None) -> Response:
    """The one place the proxy's own errors become HTTP answers (others: 500). A 5xx says
    only its request id; its detail (replicas, reasons) is one ``kvindex.proxy`` log line."""
    status, kind = 500, "internal_error"
    for kinds, code, name in _STATUS_OF:
        if isinstance(exc, kinds):
            status, kind = code, name
            break
    message = _SERVER_SIDE.get(status)
    if message is not None:
        _log_failure(exc, request_id, route, status)
    body = _error_body(message or str(exc), kind, status, request_id)
    headers = {REQUEST_ID: request_id}
    if status == 401:
        headers["www-authenticate"] = 'Bearer realm="kvindex proxy"'
    if status in (408, 413):  # the rest of the body is not read: end the connection
        headers["connection"] = "close"
    return Response(msgspec.json.encode(body), status, headers=headers, media_type=_JSON)


def _error_body(message: str, kind: str, status: int, request_id: str) -> dict[str, Any]:
    """OpenAI's error shape, with the request id (also the ``x-request-id`` header)."""
    error = {"message": message, "type": kind, "code": status, "request_id": request_id}
    return {"error": error}


def unparsed_request_body(message: str) -> bytes:
    """The 400 body of a request the HTTP parser refuses (before any route: a fresh id)."""
    body = _error_body(message, "invalid_request_error", 400, uuid.uuid4().hex)
    return msgspec.json.encode(body)


def _log_failure(exc: Exception, request_id: str, route: str | None, status: int) -> None:
    detail = {"request_id": request_id, "route": route, "status": status}
    if status == 500:
        logger.error("request %s: %d: %r", request_id, status, exc, exc_info=exc, extra=detail)
    else:
        logger.warning("request %s: %d: %s", request_id, status, exc, extra=detail)


class _Forwarded:
    """The ASGI endpoint of one forwarded route, or of the pass-through (``path`` is then
    the ``route`` label; the request's own path is sent on if allowed, else 404). It reads
    the scope and ``receive`` itself: no framework request object is made per request."""

    def __init__(self, parts: ProxyParts, path: str, *, passthrough: bool = False) -> None:
        self.parts = parts
        self.path = path
        self.passthrough = passthrough
        self.allowed = PASSTHROUGH_ROUTES | set(parts.proxy.extra_routes)
        self._owed: set[asyncio.Task[Any]] = set()  # heads' whole tokenizations, till done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        headers = _headers(scope)
        request_id = request_id_of(headers)
        exchange = Exchange(request_id, scope["method"], self.path, scope["path"], started)
        ticket = self.parts.journal.ticket(exchange)
        try:
            if self.parts.auth.guards:
                self.parts.auth.check(scope["path"], Headers(scope=scope))
            if self.passthrough and scope["path"] not in self.allowed:
                raise UnknownRouteError(f"no such route: {scope['path']}")
            answer = await self._answer(scope, receive, headers, exchange, ticket)
        except Exception as exc:
            response = _error_response(exc, request_id, route=self.path)
            response.raw_headers.extend(exchange.headers)
            self._count(response.status_code, NO_REPLICA, exchange)
            ticket.status = response.status_code
            await response(scope, receive, send)
            self.parts.journal.record(ticket)
            return
        try:
            await answer(scope, receive, send)
        finally:
            ticket.status = answer.opened.response.status_code
            self.parts.journal.record(ticket)

    async def _answer(
        self,
        scope: Scope,
        receive: Receive,
        headers: list[tuple[str, str]],
        exchange: Exchange,
        ticket: Ticket,
    ) -> StreamedAnswer:
        parts, request_id, started = self.parts, exchange.request_id, exchange.started
        deadline = parts.forwarder.deadline()
        body = await _body(scope, receive, parts.api)
        named = dict(headers)
        choice, decoded = await self._choice(body, named)
        session = named.get(SESSION_HEADER) or (decoded or {}).get("user")
        keep = parts.journal.keeps_bodies
        ticket.chose(choice, decoded, session if isinstance(session, str) else None, keep=keep)
        truth, body = _truth_reader(choice, decoded, body)
        exchange.matched_fraction = choice.matched_fraction
        if choice.untokenized:
            exchange.headers = (UNTOKENIZED,)
        metrics = parts.metrics  # a route's series appear with its first request
        if choice.matched_fraction is not None:
            metrics.timed(metrics.matched_fraction).observe(choice.matched_fraction)
        upstream_headers = forwarded_headers(
            headers, request_id, scope.get("client"), scope["scheme"]
        )
        opened = await parts.forwarder.open(
            _target(scope) if self.passthrough else self.path,
            body,
            upstream_headers,
            choice.upstreams,
            deadline,
            method=scope["method"],
            route=self.path,
            receive=receive,
            on_gone=on_gone_of(scope),
        )
        metrics.timed(metrics.first_byte, self.path).observe(time.perf_counter() - started)
        exchange.answered_by(opened.upstream.replica, choice.upstreams.index(opened.upstream))
        owed = self._owed_tokens(choice, opened.dispatch)
        if owed is not None:
            owed.then(ticket.counted)
        prediction = None if truth is None else choice.prediction(opened.upstream)
        on_truth = None if prediction is None else self._judged(prediction, choice, owed)
        return StreamedAnswer(
            opened,
            request_id,
            deadline,
            lambda status, r: self._count(status, r, exchange),
            first_chunk_timeout_s=parts.proxy.first_byte_timeout_s,
            idle_timeout_s=parts.proxy.stream_idle_timeout_s,
            truth=None if prediction is None else truth,
            on_truth=None if on_truth is None else ticket.telling(on_truth),
            extra_headers=exchange.headers,
        )

    def _owed_tokens(self, choice: Choice, dispatch: Dispatch | None) -> OwedTokens | None:
        """A head's whole tokenization, started now that its request is sent (None: none)."""
        if choice.rest is None:
            return None
        metrics = self.parts.metrics
        metrics.counted(metrics.head_decisions).inc()
        failed = metrics.head_rest_failures.inc
        return OwedTokens(choice.rest, dispatch, self._owed, on_failure=failed)

    def _judged(
        self, prediction: Prediction, choice: Choice, owed: OwedTokens | None
    ) -> Callable[[Truth | None], object]:
        """What records ``prediction`` against the engine's truth (a head's: with the prompt's
        count once known)."""
        record = self.parts.predictions.record
        if owed is None:
            return partial(record, prediction)

        def told(truth: Truth | None) -> None:
            def counted(num_tokens: int) -> None:
                record(replace(prediction, num_tokens=num_tokens), truth)

            owed.then(counted)

        return told

    async def _choice(
        self, body: bytes, headers: dict[str, str]
    ) -> tuple[Choice, dict[str, Any] | None]:
        """The replicas to try: by the scorer for a JSON object naming a model (required on
        the OpenAI routes), else (pass-through only) any replica in turn; and the body
        decoded on the OpenAI routes (None: a pass-through)."""
        if not self.passthrough:
            decoded = decoded_body(body)
            if not isinstance(decoded, dict):
                raise BadRequestBodyError("the body must be a JSON object")
            return await self.parts.picker.choose(decoded, headers), decoded
        named = _json_with_model(body, headers.get("content-type", ""))
        if named is None:
            return self.parts.picker.choose_any(), None
        return await self.parts.picker.choose(named, headers), None

    def _count(self, status: int, replica: str, exchange: Exchange) -> None:
        metrics = self.parts.metrics
        metrics.counted(metrics.requests, self.path, str(status), replica).inc()
        metrics.timed(metrics.duration, self.path).observe(time.perf_counter() - exchange.started)
        if self.parts.api.access_log:
            log_exchange(exchange, status)


def _truth_reader(
    choice: Choice, decoded: dict[str, Any] | None, body: bytes
) -> tuple[AnswerTruth | None, bytes]:
    """How the answer is read for the engine's ``usage`` (None: nothing to compare), and the
    body to send: a stream asks for its usage chunk, hidden from a client that did not."""
    if decoded is None or not choice.num_tokens:
        return None, body
    if decoded.get("stream") is not True:
        return BodyTruth(), body
    asked = with_usage_asked(body, decoded)
    return StreamTruth(hide=asked is not None), body if asked is None else asked


def _target(scope: Scope) -> str:
    """The request's path (normal, allowed: plain ASCII) and query as the client sent it."""
    path = scope["path"]
    query = scope.get("query_string", b"")
    return f"{path}?{query.decode('latin-1')}" if query else path


def _json_with_model(body: bytes, content_type: str) -> dict[str, Any] | None:
    """A JSON body's object when it names a ``model`` (None: not JSON, or no model)."""
    if not body or "json" not in content_type.lower():
        return None
    try:
        decoded = decoded_body(body)
    except msgspec.DecodeError:
        return None
    if isinstance(decoded, dict) and isinstance(decoded.get("model"), str):
        return decoded
    return None


def _guarded(
    parts: ProxyParts, endpoint: Callable[[Request], Awaitable[Response]]
) -> Callable[[Request], Awaitable[Response]]:
    """``endpoint`` behind the bearer token (:mod:`.auth`); the journal's refusals as 4xx."""

    async def guarded(request: Request) -> Response:
        try:
            parts.auth.check(request.url.path, request.headers)
            return await endpoint(request)
        except (UnauthorizedError, UnknownDecisionError, BadDecisionQueryError) as exc:
            return _error_response(exc, request_id_of(request.headers.items()))

    return guarded


async def _body(scope: Scope, receive: Receive, api: ApiSettings) -> bytes:
    """The whole body, at most ``api.max_body_bytes``, within ``api.body_timeout_s`` (one
    that has all come, as the front cycle hands it: no timer, nothing awaited)."""
    take: Callable[[], bytes | None] | None = (scope.get("extensions") or {}).get(WHOLE_BODY)
    whole = None if take is None else take()
    if whole is not None and len(whole) <= api.max_body_bytes:
        return whole
    if whole is not None:
        raise BodyTooLargeError(f"request body too large: over {api.max_body_bytes} bytes")
    declared = next((v for n, v in scope["headers"] if n == b"content-length"), None)
    limit = api.max_body_bytes
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLargeError(
            f"request body too large: Content-Length {declared.decode()}, limit {limit}"
        )
    chunks: list[bytes] = []
    num_bytes = 0
    try:
        async with asyncio.timeout(api.body_timeout_s):
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise BodyTimeoutError("the client went away before sending its body")
                chunk, more = message.get("body", b""), message.get("more_body", False)
                num_bytes += len(chunk)
                if num_bytes > limit:
                    raise BodyTooLargeError(f"request body too large: over {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeoutError(f"request body not received within {api.body_timeout_s} s") from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _json(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status, media_type=_JSON)


async def _ok(_: Request) -> Response:
    return _json({"status": "ok"})


def _models(parts: ProxyParts) -> Callable[[Request], Awaitable[Response]]:
    async def models(_: Request) -> Response:
        names = await parts.off_loop(parts.registry.models)
        data = [_model_entry(m) for m in names]
        specs = [m for m in parts.api.models if m.name in names]
        data += [_model_entry(lora, parent=m.name) for m in specs for lora in m.loras]
        return _json({"object": "list", "data": data})

    return models


def _model_entry(name: str, parent: str | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "kvindex"}
    if parent is not None:
        entry["parent"] = parent
    return entry


def _ready(parts: ProxyParts) -> Callable[[Request], Awaitable[Response]]:
    """200 while the index store answers and a replica is routable, else 503 saying why
    (replica ids and reasons only: the route is open, so the store's error is logged)."""
    policy = health_policy(parts.api)

    def unroutable() -> str | None:
        replicas = [r.id for r in parts.registry.replicas() if r.url]
        if not replicas:
            return "no replica with a url is registered"
        now, health = time.time(), parts.registry.replica_health()
        out = {r: health[r].ejection(now, policy) for r in replicas if r in health}
        if len(replicas) > sum(1 for why in out.values() if why is not None):
            return None
        whys = ", ".join(f"{r} ({why.value})" for r, why in out.items() if why is not None)
        return f"every replica is out of routing: {whys}"

    async def ready(_: Request) -> Response:
        try:
            await parts.off_loop(parts.index.streams)
        except IndexUnavailableError as exc:
            logger.warning("not ready: the index store is unavailable: %s", exc)
            return _json({"status": "unavailable", "detail": "the index store is unavailable"}, 503)
        why = await parts.off_loop(unroutable)
        if why is not None:
            return _json({"status": "unavailable", "detail": why}, 503)
        mismatches = parts.verdicts.mismatches()  # ready, but routing on miscounted prompts
        if mismatches:
            return _json({"status": "ready", "detail": "; ".join(m.describe() for m in mismatches)})
        return _json({"status": "ready"})

    return ready


def _metrics(parts: ProxyParts) -> Callable[[Request], Awaitable[Response]]:
    async def metrics(_: Request) -> Response:
        if parts.scrape is not None:
            return Response(await parts.scrape.render(), media_type=_METRICS)

        # The write path's series read the index: off the loop, as the API's /metrics.
        def render() -> bytes:
            return parts.metrics.render(parts.registry.models())

        return Response(await parts.off_loop(render), media_type=_METRICS)

    return metrics


def _fleet_routes(parts: ProxyParts) -> list[Route]:
    """``GET /replicas`` and ``GET /stats`` as the API answers them (what ``kvindex
    replicas`` and ``kvindex stats`` read), behind the token; none without the stores."""
    loads, block_sizes = parts.loads, parts.block_sizes
    if loads is None or block_sizes is None:
        return []
    policy = health_policy(parts.api)

    async def replicas(_: Request) -> Response:
        views = await parts.off_loop(
            replica_views, parts.registry, parts.index, loads, block_sizes, policy
        )
        accuracy = parts.predictions.accuracy()
        body = msgspec.to_builtins(views)
        for view in body:  # the proxy's own: each replica's predictions against its answers
            counts = accuracy.get(view["id"])
            view["predictions"] = (counts or Accuracy({})).view()
            view["predictions"]["verdict"] = parts.verdicts.view(view["id"])
        return _json(body)

    async def stats(_: Request) -> Response:
        return _json(await parts.off_loop(stats_view, parts.registry, parts.index))

    return [
        Route("/replicas", _guarded(parts, replicas), methods=["GET"]),
        Route("/stats", _guarded(parts, stats), methods=["GET"]),
    ]
