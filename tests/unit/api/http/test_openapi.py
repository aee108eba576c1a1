"""kvindex.api.http.openapi: route operations refer to msgspec-generated components, merged once.

That the document matches what is served is tested against the app (tests/integration).
"""

from __future__ import annotations

from fastapi import FastAPI

from kvindex.api.http.openapi import document, operation
from kvindex.api.schemas import ErrorBody, ReplicaView, ScoreRequest, ScoreResponse

JSON = "application/json"


def ref(kind: type) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{kind.__name__}"}


def test_an_operation_refers_to_its_body_answer_and_error() -> None:
    assert operation(ScoreRequest, ScoreResponse, "Rank") == {
        "summary": "Rank",
        "requestBody": {"required": True, "content": {JSON: {"schema": ref(ScoreRequest)}}},
        "responses": {
            "default": {"description": "Error", "content": {JSON: {"schema": ref(ErrorBody)}}},
            "200": {"description": "OK", "content": {JSON: {"schema": ref(ScoreResponse)}}},
        },
    }


def test_many_answers_are_an_array_and_no_body_no_request_body() -> None:
    extra = operation(None, ReplicaView, "List", many=True)
    assert "requestBody" not in extra
    schema = extra["responses"]["200"]["content"][JSON]["schema"]
    assert schema == {"type": "array", "items": ref(ReplicaView)}


def test_a_creating_operation_documents_its_201() -> None:
    responses = operation(ScoreRequest, ScoreResponse, "Make", created=True)["responses"]
    assert responses["201"] == {
        "description": "Created",
        "content": {JSON: {"schema": ref(ScoreResponse)}},
    }
    assert "201" not in operation(ScoreRequest, ScoreResponse, "Rank")["responses"]


def test_a_text_answer_documents_its_media_type() -> None:
    responses = operation(summary="Metrics", text="text/plain; version=0.0.4")["responses"]
    assert responses["200"]["content"] == {
        "text/plain; version=0.0.4": {"schema": {"type": "string"}}
    }


def test_document_merges_the_components_once() -> None:
    app = FastAPI()
    document(app)
    schema = app.openapi()
    components = schema["components"]["schemas"]
    assert {"ScoreRequest", "ScoreResponse", "ReplicaView", "ErrorBody", "StreamView"} <= set(
        components
    )
    assert components["ScoreRequest"]["required"] == ["model"]
    assert app.openapi() is schema
