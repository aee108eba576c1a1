"""The FastAPI app over one read path: routes decode with msgspec, call the library and
encode; errors become HTTP in one place (:func:`_error_response`)."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import msgspec
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import Histogram
from starlette.datastructures import Headers
from starlette.routing import BaseRoute

from kvindex.api.config.url_policy import UntrustedUrlError
from kvindex.api.health.routing import health_policy
from kvindex.api.http.body_limit import BodyLimit, BodyTimeoutError, BodyTooLargeError
from kvindex.api.http.hot_routes import HotRoute, HotRoutes, HotServing
from kvindex.api.http.metrics import ApiMetrics, TimedIndex
from kvindex.api.http.openapi import document, operation
from kvindex.api.http.traffic import TrafficObserver
from kvindex.api.http.views import config_view, replica_views, stats_view
from kvindex.api.load.model import Load, LoadError
from kvindex.api.runtime import ApiDeps, Hooks, build_read_path
from kvindex.api.schemas import (
    ConfigView,
    ErrorBody,
    LoadReport,
    ReplicaIn,
    ReplicaView,
    ScoreRequest,
    ScoreResponse,
    StatsView,
    StatusBody,
    decode_score_request,
    nested_too_deep,
)
from kvindex.api.score import RequestError, UnknownModelError
from kvindex.api.tokenize.protocol import TokenizerError
from kvindex.indexer.domain.errors import KvIndexError, SettingsError
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.protocol import IndexUnavailableError, drop_replica

T = TypeVar("T")
_JSON = "application/json"
_METRICS = "text/plain; version=0.0.4; charset=utf-8"


def create_app(deps: ApiDeps, *, lean_routes: bool = True) -> FastAPI:
    state = _AppState(deps)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.read_path.start()
        try:
            yield
        finally:
            await state.read_path.stop()

    guarded = deps.settings.auth_token is not None
    app = FastAPI(
        title="kvindex",
        version="0.1.0",
        summary="Where every KV-cache block of a vLLM fleet lives, and where to route.",
        lifespan=lifespan,
        # With a token, the schema is served behind it (below) and the browsable docs,
        # which could not send the token, are off.
        openapi_url=None if guarded else "/openapi.json",
        docs_url=None if guarded else "/docs",
        redoc_url=None if guarded else "/redoc",
        # FastAPI's own OpenTelemetry spans and metrics are off: the app has its metrics
        # (kvindex.api.http.traffic), and the check alone costs a visible share of the HTTP
        # floor (bench/http_floor.py).
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    health, routes = _health_routes(state), _routes(state)
    app.include_router(health)
    app.include_router(routes, dependencies=[Depends(state.authorize)])
    if lean_routes:  # added first, so innermost: the body limit and the traffic see them
        hot = _hot_routes(state, health, routes)
        app.add_middleware(
            HotRoutes, routes=hot, authorize=state.check_token, error_response=_error_response
        )
        # The same routes for a server that answers them itself (kvindex.api.http.server_protocol),
        # counted by an observer of the same metrics as the app's.
        observer = TrafficObserver(app, metrics=state.metrics, access_log=deps.settings.access_log)
        app.state.hot_serving = HotServing.build(
            hot,
            authorize=state.check_token,
            error_response=_error_response,
            observe=observer.observe,
            max_body_bytes=deps.settings.max_body_bytes,
            body_timeout_s=deps.settings.body_timeout_s,
        )
    app.add_middleware(
        BodyLimit,
        max_bytes=deps.settings.max_body_bytes,
        timeout_s=deps.settings.body_timeout_s,
    )
    # Added last, so outermost: it sees every answer, the body limit's included.
    app.add_middleware(TrafficObserver, metrics=state.metrics, access_log=deps.settings.access_log)
    app.add_exception_handler(KvIndexError, _error_handler)
    app.add_exception_handler(msgspec.ValidationError, _error_handler)
    app.add_exception_handler(msgspec.DecodeError, _error_handler)
    document(app)
    if guarded:

        async def openapi_document() -> JSONResponse:
            return JSONResponse(app.openapi())

        app.add_api_route(
            "/openapi.json",
            openapi_document,
            include_in_schema=False,
            dependencies=[Depends(state.authorize)],
        )
    app.state.read_path = state.read_path
    return app


def hot_serving(app: FastAPI) -> HotServing | None:
    serving: HotServing | None = getattr(app.state, "hot_serving", None)
    return serving


class _AppState:
    def __init__(self, deps: ApiDeps) -> None:
        circuit = deps.circuit
        metrics = self.metrics = ApiMetrics(
            deps.registry,
            deps.index,
            runs_write_path=deps.runs_write_path,
            store_up=lambda: circuit is None or not circuit.is_open,
            rule_names=[rule.name for rule in deps.settings.rules],
        )
        hooks = Hooks(
            wrap_index=lambda index: TimedIndex(index, metrics.lookup_latency),
            on_degraded=lambda reason: metrics.degraded_answers.labels(reason).inc(),
            on_scrape_failure=lambda replica: metrics.scrape_failures.labels(replica).inc(),
        )
        self.read_path = read_path = build_read_path(deps, hooks)
        metrics.watch_block_sizes(read_path.block_sizes)
        self.deps = deps
        self.off_loop = read_path.off_loop
        self.index, self.scorer = read_path.index, read_path.scorer
        self.tokenizers, self.block_sizes = read_path.tokenizers, read_path.block_sizes
        self.url_policy = deps.settings.url_policy()
        self._score_latency: dict[str, Histogram] = {}

    async def score(self, body: bytes, headers: Headers) -> bytes:
        """``POST /score``'s answer, for FastAPI's route and the hot ones."""
        started = time.perf_counter()
        request, packed = decode_score_request(body)
        answer = await self.scorer.score(request, headers, packed_tokens=packed)
        latency = self._score_latency.get(answer.policy)
        if latency is None:  # kept per policy: a few, and labels() costs a lock and a lookup
            latency = self._score_latency[answer.policy] = self.metrics.score_latency.labels(
                answer.policy
            )
        latency.observe(time.perf_counter() - started)
        self.metrics.count_rule(answer.rule)
        return msgspec.json.encode(answer)

    async def authorize(self, request: Request) -> None:
        self.check_token(request.headers)

    def check_token(self, headers: Headers) -> None:
        """UnauthorizedError unless the bearer token is the configured one (if any)."""
        token = self.deps.settings.auth_token
        if token is None:
            return
        given = headers.get("authorization", "").encode()
        # Constant-time comparison: the answer time must not reveal a prefix of the token.
        if not secrets.compare_digest(given, f"Bearer {token}".encode()):
            raise UnauthorizedError("missing or wrong bearer token")


class UnauthorizedError(KvIndexError):
    pass


def _json(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status_code=status, media_type=_JSON)


async def _decode(request: Request, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(await request.body(), type=kind)
    except RecursionError:
        raise nested_too_deep() from None


_STATUS_OF: tuple[tuple[tuple[type[BaseException], ...], int, str], ...] = (
    (
        (
            msgspec.ValidationError,
            msgspec.DecodeError,
            RequestError,
            SettingsError,
            LoadError,
            UntrustedUrlError,
        ),
        422,
        "invalid_request",
    ),
    ((BodyTooLargeError,), 413, "body_too_large"),
    ((BodyTimeoutError,), 408, "body_timeout"),
    ((UnknownModelError,), 404, "unknown_model"),
    ((UnauthorizedError,), 401, "unauthorized"),
    ((TokenizerError,), 502, "tokenizer_failed"),
    ((IndexUnavailableError,), 503, "store_unavailable"),
)


def _error_response(exc: Exception) -> Response:
    for kinds, status, name in _STATUS_OF:
        if isinstance(exc, kinds):
            response = _json(ErrorBody(name, str(exc)), status)
            if status == 401:  # RFC 6750: say which scheme to use
                response.headers["www-authenticate"] = 'Bearer realm="kvindex"'
            if status in (408, 413):  # the rest of the body is not read: end the connection
                response.headers["connection"] = "close"
            return response
    return _json(ErrorBody("internal", str(exc)), 500)


async def _error_handler(_: Request, exc: Exception) -> Response:
    return _error_response(exc)


# --- routes -------------------------------------------------------------------------------


def _health_routes(state: _AppState) -> APIRouter:
    router = APIRouter(tags=["health"])

    @router.get("/healthz", summary="The process is up")
    async def healthz() -> Response:
        return Response(await _healthz(b"", _NO_HEADERS), media_type=_JSON)

    @router.get("/readyz", summary="The index store is reachable")
    async def readyz() -> Response:
        try:
            await state.off_loop(state.index.streams)
        except IndexUnavailableError as exc:
            return _json({"status": "unavailable", "detail": str(exc)}, 503)
        return _json({"status": "ready"})

    return router


def _routes(state: _AppState) -> APIRouter:
    router = APIRouter()
    _score_routes(router, state)
    _replica_routes(router, state)
    _info_routes(router, state)
    return router


def _score_routes(router: APIRouter, state: _AppState) -> None:
    @router.post(
        "/score",
        openapi_extra=operation(
            ScoreRequest, ScoreResponse, "Rank the candidate replicas for a request"
        ),
    )
    async def score(request: Request) -> Response:
        answer = await state.score(await request.body(), request.headers)
        return Response(answer, media_type=_JSON)

    @router.post(
        "/load", openapi_extra=operation(LoadReport, StatusBody, "Report a replica's load")
    )
    async def load(request: Request) -> Response:
        report = await _decode(request, LoadReport)
        if state.deps.registry.get(report.replica) is None:
            raise RequestError(f"replica: {report.replica!r} is not registered")
        now = time.time()
        measured = Load(
            report.running,
            report.waiting,
            report.kv_usage,
            report.ts if report.ts is not None else now,
            "push",
        ).validated(now=now)
        await state.off_loop(state.deps.loads.put, report.replica, measured)
        state.scorer.note_load(report.replica, measured)
        return _json(StatusBody("ok"))


def _replica_routes(router: APIRouter, state: _AppState) -> None:
    registry = state.deps.registry

    @router.get(
        "/replicas",
        openapi_extra=operation(None, ReplicaView, "Replicas, streams and load", many=True),
    )
    async def replicas() -> Response:
        views = await state.off_loop(
            replica_views,
            registry,
            state.index,
            state.deps.loads,
            state.block_sizes,
            health_policy(state.deps.settings),
        )
        return _json(views)

    @router.post(
        "/replicas",
        openapi_extra=operation(
            ReplicaIn, StatusBody, "Register a replica (201: new, 200: already so)", created=True
        ),
    )
    async def add_replica(request: Request) -> Response:
        body = await _decode(request, ReplicaIn)
        spec = ReplicaSpec(
            id=body.id,
            model=body.model,
            events=body.events,
            replay=body.replay,
            url=body.url,
            dp_size=body.dp_size,
        )
        if spec.url is not None:
            await state.url_policy.check(spec.url)
        created = await state.off_loop(registry.add, spec)
        state.tokenizers.forget(spec.model)
        return _json(
            StatusBody("created" if created else "unchanged", spec.id), 201 if created else 200
        )

    @router.delete(
        "/replicas/{replica_id}",
        openapi_extra=operation(None, StatusBody, "Remove a replica and purge its blocks"),
    )
    async def remove_replica(replica_id: str) -> Response:
        spec = await state.off_loop(registry.get, replica_id)
        if spec is None:
            return _json(ErrorBody("unknown_replica", f"no replica {replica_id!r}"), 404)
        # Store calls first: if the store is down (503) the replica is still registered and
        # the call can be retried. A subscriber that writes in between purges again once it
        # sees the replica gone.
        await state.off_loop(drop_replica, state.index, replica_id)
        await state.off_loop(state.deps.loads.remove, replica_id)
        await state.off_loop(registry.remove, replica_id)
        state.scorer.forget(replica_id)
        state.tokenizers.forget(spec.model)
        return _json(StatusBody("removed", replica_id))


def _info_routes(router: APIRouter, state: _AppState) -> None:
    @router.get("/stats", openapi_extra=operation(None, StatsView, "Index and ingestion totals"))
    async def stats() -> Response:
        return _json(await state.off_loop(stats_view, state.deps.registry, state.index))

    @router.get(
        "/config", openapi_extra=operation(None, ConfigView, "Policies, default weights and models")
    )
    async def config() -> Response:
        return _json(config_view(state.deps.settings, state.scorer))

    @router.get(
        "/metrics",
        response_class=Response,
        openapi_extra=operation(summary="Prometheus metrics", text=_METRICS),
    )
    async def metrics() -> Response:
        body = await state.off_loop(state.metrics.render)
        return Response(body, media_type=_METRICS)


_HEALTHY = msgspec.json.encode({"status": "ok"})
_NO_HEADERS = Headers()


async def _healthz(_body: bytes, _headers: Headers) -> bytes:
    return _HEALTHY


def _hot_routes(state: _AppState, health: APIRouter, routes: APIRouter) -> list[HotRoute]:
    return [
        HotRoute(
            "GET", "/healthz", _route(health, "/healthz"), _healthz, guarded=False, reads_body=False
        ),
        HotRoute(
            "POST", "/score", _route(routes, "/score"), state.score, guarded=True, reads_body=True
        ),
    ]


def _route(router: APIRouter, path: str) -> BaseRoute:
    (route,) = [r for r in router.routes if getattr(r, "path", None) == path]
    return route
