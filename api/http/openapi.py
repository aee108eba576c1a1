"""The OpenAPI document, generated from the msgspec types the routes decode and encode."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI

from kvindex.api import schemas
from kvindex.api.dynamo import schemas as dynamo

_JSON = "application/json"

_SCHEMA_TYPES: list[Any] = [
    schemas.ScoreRequest,
    schemas.ScoreResponse,
    schemas.LoadReport,
    schemas.ReplicaIn,
    schemas.ReplicaView,
    schemas.ErrorBody,
    schemas.StatusBody,
    schemas.StatsView,
    schemas.ConfigView,
    dynamo.RegisterRequest,
    dynamo.UnregisterRequest,
    dynamo.QueryRequest,
    dynamo.QueryByHashRequest,
    dynamo.Worker,
    dynamo.Overlap,
    dynamo.DynamoStatus,
    dynamo.DynamoError,
]
"""Every body a route decodes or encodes, in the document's order."""
_, _COMPONENTS = msgspec.json.schema_components(
    _SCHEMA_TYPES, ref_template="#/components/schemas/{name}"
)


def operation(
    body: type | None = None,
    response: type | None = None,
    summary: str = "",
    *,
    many: bool = False,
    created: bool = False,
    text: str | None = None,
    error: type = schemas.ErrorBody,
) -> dict[str, Any]:
    """``openapi_extra`` for a route of msgspec bodies (``many``: a list; ``created``: also a
    201; ``text``: a text answer instead); every error answers with an ``error``."""
    extra: dict[str, Any] = {"summary": summary}
    if body is not None:
        extra["requestBody"] = {
            "required": True,
            "content": {_JSON: {"schema": _ref(body)}},
        }
    responses: dict[str, Any] = {
        "default": {"description": "Error", "content": {_JSON: {"schema": _ref(error)}}}
    }
    if response is not None:
        schema = {"type": "array", "items": _ref(response)} if many else _ref(response)
        responses["200"] = {"description": "OK", "content": {_JSON: {"schema": schema}}}
        if created:
            responses["201"] = {"description": "Created", "content": {_JSON: {"schema": schema}}}
    if text is not None:
        responses["200"] = {"description": "OK", "content": {text: {"schema": {"type": "string"}}}}
    extra["responses"] = responses
    return extra


def dynamo_operation(
    body: type | None, response: type | None, summary: str, *, many: bool = False
) -> dict[str, Any]:
    """``openapi_extra`` of a Dynamo route: its errors are ``{"error": ...}``, a 201 on register."""
    created = body is dynamo.RegisterRequest
    return operation(body, response, summary, many=many, created=created, error=dynamo.DynamoError)


def _ref(kind: type) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{kind.__name__}"}


def document(app: FastAPI) -> None:
    """Merge the msgspec-generated schemas into FastAPI's OpenAPI document."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(_COMPONENTS)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
