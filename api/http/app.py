"""The FastAPI app over one read path (:class:`~kvindex.api.http.core.ApiCore`): routes
decode with msgspec, call the library and encode; errors become HTTP in one place
(:func:`~kvindex.api.http.core.error_response`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TypeVar

import msgspec
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers

from kvindex.api.health.routing import health_policy
from kvindex.api.http.body_limit import BodyLimit
from kvindex.api.http.core import ApiCore, error_response, healthz, json_response
from kvindex.api.http.dynamo_routes import dynamo_router
from kvindex.api.http.hot_routes import HotRoutes, HotServing
from kvindex.api.http.openapi import document, operation
from kvindex.api.http.traffic import TrafficObserver
from kvindex.api.http.views import config_view, replica_views, stats_view
from kvindex.api.load.model import Load
from kvindex.api.runtime import ApiDeps
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
    nested_too_deep,
)
from kvindex.api.score import RequestError
from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.fleet.replica import ReplicaSpec

T = TypeVar("T")
_JSON = "application/json"
_METRICS = "text/plain; version=0.0.4; charset=utf-8"


def create_app(deps: ApiDeps, *, lean_routes: bool = True) -> FastAPI:
    """The FastAPI app over a new :class:`ApiCore` on ``deps``, its lifespan the read path's."""
    core = ApiCore(deps)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await core.read_path.start()
        try:
            yield
        finally:
            await core.read_path.stop()

    return app_of(core, lean_routes=lean_routes, lifespan=lifespan)


def app_of(
    core: ApiCore,
    *,
    lean_routes: bool = True,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
) -> FastAPI:
    """The FastAPI app answering with ``core`` (without ``lifespan``, whoever serves it
    starts and stops ``core.read_path``)."""
    guarded = core.deps.settings.auth_token is not None
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
    authorize = _authorize(core)
    app.include_router(_health_routes(core))
    app.include_router(_routes(core), dependencies=[Depends(authorize)])
    app.include_router(dynamo_router(core), dependencies=[Depends(authorize)])
    settings = core.deps.settings
    if lean_routes:  # added first, so innermost: the body limit and the traffic see them
        app.add_middleware(
            HotRoutes,
            routes=core.hot_routes(),
            authorize=core.check_token,
            error_response=error_response,
        )
        # The same routes for a server that answers them itself (kvindex.api.http.server_protocol),
        # counted by an observer of the same metrics as the app's.
        observer = TrafficObserver(app, metrics=core.metrics, access_log=settings.access_log)
        app.state.hot_serving = core.hot_serving(observer)
    app.add_middleware(
        BodyLimit, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s
    )
    # Added last, so outermost: it sees every answer, the body limit's included.
    app.add_middleware(TrafficObserver, metrics=core.metrics, access_log=settings.access_log)
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
            dependencies=[Depends(authorize)],
        )
    app.state.read_path = core.read_path
    return app


def hot_serving(app: FastAPI) -> HotServing | None:
    serving: HotServing | None = getattr(app.state, "hot_serving", None)
    return serving


def _authorize(core: ApiCore) -> Callable[[Request], Awaitable[None]]:
    async def authorize(request: Request) -> None:
        core.check_token(request.headers)

    return authorize


async def _decode(request: Request, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(await request.body(), type=kind)
    except RecursionError:
        raise nested_too_deep() from None


async def _error_handler(_: Request, exc: Exception) -> Response:
    return error_response(exc)


# --- routes -------------------------------------------------------------------------------


def _health_routes(core: ApiCore) -> APIRouter:
    router = APIRouter(tags=["health"])

    @router.get("/healthz", summary="The process is up")
    async def healthz_route() -> Response:
        return Response(await healthz(b"", _NO_HEADERS), media_type=_JSON)

    @router.get("/readyz", summary="The index store is reachable")
    async def readyz() -> Response:
        return Response(await core.readyz(b"", _NO_HEADERS), media_type=_JSON)

    return router


def _routes(core: ApiCore) -> APIRouter:
    router = APIRouter()
    _score_routes(router, core)
    _replica_routes(router, core)
    _info_routes(router, core)
    return router


def _score_routes(router: APIRouter, core: ApiCore) -> None:
    @router.post(
        "/score",
        openapi_extra=operation(
            ScoreRequest, ScoreResponse, "Rank the candidate replicas for a request"
        ),
    )
    async def score(request: Request) -> Response:
        answer = await core.score(await request.body(), request.headers)
        return Response(answer, media_type=_JSON)

    @router.post(
        "/load", openapi_extra=operation(LoadReport, StatusBody, "Report a replica's load")
    )
    async def load(request: Request) -> Response:
        report = await _decode(request, LoadReport)
        if core.deps.registry.get(report.replica) is None:
            raise RequestError(f"replica: {report.replica!r} is not registered")
        now = time.time()
        measured = Load(
            report.running,
            report.waiting,
            report.kv_usage,
            report.ts if report.ts is not None else now,
            "push",
        ).validated(now=now)
        await core.off_loop(core.deps.loads.put, report.replica, measured)
        core.scorer.note_load(report.replica, measured)
        return json_response(StatusBody("ok"))


def _replica_routes(router: APIRouter, core: ApiCore) -> None:
    registry = core.deps.registry

    @router.get(
        "/replicas",
        openapi_extra=operation(None, ReplicaView, "Replicas, streams and load", many=True),
    )
    async def replicas() -> Response:
        views = await core.off_loop(
            replica_views,
            registry,
            core.index,
            core.deps.loads,
            core.block_sizes,
            health_policy(core.deps.settings),
        )
        return json_response(views)

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
            await core.url_policy.check(spec.url)
        created = await core.off_loop(registry.add, spec)
        core.tokenizers.forget(spec.model)
        return json_response(
            StatusBody("created" if created else "unchanged", spec.id), 201 if created else 200
        )

    @router.delete(
        "/replicas/{replica_id}",
        openapi_extra=operation(None, StatusBody, "Remove a replica and purge its blocks"),
    )
    async def remove_replica(replica_id: str) -> Response:
        spec = await core.off_loop(registry.get, replica_id)
        if spec is None:
            return json_response(ErrorBody("unknown_replica", f"no replica {replica_id!r}"), 404)
        await core.remove_replica(spec)
        return json_response(StatusBody("removed", replica_id))


def _info_routes(router: APIRouter, core: ApiCore) -> None:
    @router.get("/stats", openapi_extra=operation(None, StatsView, "Index and ingestion totals"))
    async def stats() -> Response:
        return json_response(await core.off_loop(stats_view, core.deps.registry, core.index))

    @router.get(
        "/config", openapi_extra=operation(None, ConfigView, "Policies, default weights and models")
    )
    async def config() -> Response:
        return json_response(config_view(core.deps.settings, core.scorer))

    @router.get(
        "/metrics",
        response_class=Response,
        openapi_extra=operation(summary="Prometheus metrics", text=_METRICS),
    )
    async def metrics() -> Response:
        body = await core.off_loop(core.metrics.render)
        return Response(body, media_type=_METRICS)


_NO_HEADERS = Headers()
