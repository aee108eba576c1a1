"""Dynamo's standalone-indexer routes at its paths over a :class:`DynamoFront`; a refusal
answers as Dynamo's, ``{"error": ...}``: bad bodies 422, unknown 404, duplicates 409, store 503."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import Counter

from kvindex.api.dynamo import schemas
from kvindex.api.dynamo.dump import dump
from kvindex.api.dynamo.front import DynamoApiError, DynamoFront, ReadPathParts
from kvindex.api.http.core import ApiCore, json_response
from kvindex.api.http.openapi import dynamo_operation
from kvindex.indexer.domain.errors import SettingsError
from kvindex.indexer.domain.keys import BlockKeyError
from kvindex.indexer.index.block_journal import BlockJournal, JournaledIndex
from kvindex.indexer.index.protocol import IndexUnavailableError

T = TypeVar("T")
_ROUTES = ("/register", "/unregister", "/workers", "/query", "/query_by_hash")
log = logging.getLogger(__name__)
_OK = schemas.DynamoStatus("ok")


def dynamo_router(core: ApiCore) -> APIRouter:
    """The routes, tagged ``dynamo``; refusals counted in ``kvindex_dynamo_refusals_total``."""
    parts = ReadPathParts(
        core.deps.settings,
        core.deps.registry,
        core.index,
        core.off_loop,
        core.remove_replica,
        core.tokenizers.forget,
    )
    front = DynamoFront(parts)
    refusals = Counter(
        "kvindex_dynamo_refusals",
        "Calls to Dynamo's indexer routes refused (4xx, 503), by route",
        ["route"],
        registry=core.metrics.registry,
    )
    for route in _ROUTES:
        refusals.labels(route)
    router = APIRouter(tags=["dynamo"])

    async def answer(route: str, call: Callable[[], Awaitable[Response]]) -> Response:
        try:
            return await call()
        except _REFUSED as exc:
            status, message = _refusal(exc)
        refusals.labels(route).inc()
        log.info("dynamo %s refused (%d): %s", route, status, message)
        return json_response(schemas.DynamoError(message), status)

    _fleet_routes(router, front, answer)
    _query_routes(router, front, answer)
    if isinstance(core.deps.index, JournaledIndex):
        _dump_route(router, core, core.deps.index.journal, front)
    return router


Answer = Callable[[str, Callable[[], Awaitable[Response]]], Awaitable[Response]]
"""A route's call run, a refusal answered as Dynamo's and counted."""


def _fleet_routes(router: APIRouter, front: DynamoFront, answer: Answer) -> None:
    @router.post(
        "/register",
        openapi_extra=dynamo_operation(
            schemas.RegisterRequest, schemas.DynamoStatus, "Register one rank"
        ),
    )
    async def register(request: Request) -> Response:
        async def call() -> Response:
            await front.register(await _decode(request, schemas.RegisterRequest))
            return json_response(_OK, 201)

        return await answer("/register", call)

    @router.post(
        "/unregister",
        openapi_extra=dynamo_operation(
            schemas.UnregisterRequest, schemas.DynamoStatus, "Drop an instance"
        ),
    )
    async def unregister(request: Request) -> Response:
        async def call() -> Response:
            await front.unregister(await _decode(request, schemas.UnregisterRequest))
            return json_response(_OK)

        return await answer("/unregister", call)

    @router.get(
        "/workers",
        openapi_extra=dynamo_operation(
            None, schemas.Worker, "Instances, ranks, endpoints", many=True
        ),
    )
    async def workers() -> Response:
        async def call() -> Response:
            return json_response(await front.workers())

        return await answer("/workers", call)


def _query_routes(router: APIRouter, front: DynamoFront, answer: Answer) -> None:
    @router.post(
        "/query",
        openapi_extra=dynamo_operation(schemas.QueryRequest, schemas.Overlap, "Matched tokens"),
    )
    async def query(request: Request) -> Response:
        async def call() -> Response:
            return json_response(await front.query(await _decode(request, schemas.QueryRequest)))

        return await answer("/query", call)

    @router.post(
        "/query_by_hash",
        openapi_extra=dynamo_operation(
            schemas.QueryByHashRequest, schemas.Overlap, "Matched tokens of kvindex block keys"
        ),
    )
    async def query_by_hash(request: Request) -> Response:
        async def call() -> Response:
            body = await _decode(request, schemas.QueryByHashRequest)
            return json_response(await front.query_by_hash(body))

        return await answer("/query_by_hash", call)


def _dump_route(
    router: APIRouter, core: ApiCore, journal: BlockJournal, front: DynamoFront
) -> None:
    registry = core.deps.registry

    def model_of(replica: str) -> str | None:
        spec = registry.get(replica)
        return None if spec is None else spec.model

    @router.get("/dump", openapi_extra=dynamo_operation(None, None, "The index as stored events"))
    async def dump_route() -> Response:
        return json_response(await core.off_loop(dump, journal, model_of, front.block_size))


_REFUSED = (
    DynamoApiError,
    msgspec.ValidationError,
    msgspec.DecodeError,
    SettingsError,
    BlockKeyError,
    IndexUnavailableError,
)


def _refusal(exc: Exception) -> tuple[int, str]:
    if isinstance(exc, DynamoApiError):
        return exc.status, str(exc)
    if isinstance(exc, IndexUnavailableError):
        return 503, f"index store unavailable: {exc}"
    return 422, f"invalid body: {exc}"


async def _decode(request: Request, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(await request.body(), type=kind)
    except RecursionError:
        raise msgspec.DecodeError("JSON nested too deep") from None
