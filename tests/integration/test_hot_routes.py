"""The hot routes answer as FastAPI's routes do: one app with them, one without, same requests.

Two in-process apps (``httpx.ASGITransport``) over twin memory-store fleets filled the same
way, one built with the plain-ASGI :class:`~kvindex.api.http.hot_routes.HotRoutes` (as served),
one with FastAPI's routes alone (``lean_routes=False``). Every request goes to both, in the
same order (each app's scorer then makes the same choices), and the two answers must agree:
status, body and the headers a client acts on. Then what the hot routes must keep beyond the
answer: the traffic metrics' route label, the OpenAPI document, the other methods and paths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvindex.api.config.settings import ApiSettings
from kvindex.api.load.store import MemoryLoadStore
from kvindex.indexer.index.memory import MemoryIndex
from tests.integration.api_harness import MODEL, Api, comparable_body, open_api, tokens

SETTINGS = ApiSettings(scrape_interval_s=0, seed=7, max_body_bytes=4096)
TOKEN = "s3cret-token"
_HEADERS = ("content-type", "www-authenticate", "connection")
"""The answer's headers that must agree (the ones a client acts on; the length is checked
against each body)."""
"""The fields of an answer that depend on when it was made (how long since a stream was
heard): left out of the comparison."""


def _pair(settings: ApiSettings) -> Iterator[tuple[Api, Api]]:
    apis = [
        open_api(settings, MemoryIndex(), MemoryLoadStore(), blocking_store=False, lean_routes=lean)
        for lean in (True, False)
    ]
    try:
        for api in apis:
            api.fleet.add("r1", "r2", "r3")
            api.fleet.store("r1", tokens(1_000, 8))
            api.fleet.store("r2", tokens(1_000, 3))
        yield apis[0], apis[1]
    finally:
        for api in apis:
            api.close()


@pytest.fixture
def twins() -> Iterator[tuple[Api, Api]]:
    yield from _pair(SETTINGS)


@pytest.fixture
def guarded_twins() -> Iterator[tuple[Api, Api]]:
    yield from _pair(dataclasses.replace(SETTINGS, auth_token=TOKEN))


def same_answer(
    twins: tuple[Api, Api],
    method: str,
    path: str,
    *,
    content: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """Send one request to both apps; assert the answers agree; return the lean one's."""
    lean, framework = (api.request(method, path, content=content, headers=headers) for api in twins)
    assert lean.status_code == framework.status_code, (lean.text, framework.text)
    assert comparable_body(lean.content) == comparable_body(framework.content)
    for name in _HEADERS:
        assert lean.headers.get(name) == framework.headers.get(name), name
    for answer in (lean, framework):
        if answer.request.method != "HEAD":
            assert answer.headers["content-length"] == str(len(answer.content))
    return lean


def _score_body(**fields: object) -> bytes:
    return msgspec.json.encode({"model": MODEL} | fields)


@pytest.mark.parametrize(
    "fields",
    [
        {"token_ids": tokens(1_000, 8)},
        {"token_ids": tokens(1_000, 3, tail=7)},
        {"token_ids": tokens(77_000, 2)},
        {"token_ids": tokens(1_000, 8), "top_k": 1, "policy": "least_load"},
        {"block_keys": [1, 2, 3]},
    ],
)
def test_a_valid_score_request_gets_the_same_answer(
    twins: tuple[Api, Api], fields: dict[str, object]
) -> None:
    for _ in range(3):  # the scorers' state (answers counted per replica) moves in step
        answer = same_answer(twins, "POST", "/score", content=_score_body(**fields))
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"] == "application/json"


@pytest.mark.parametrize(
    ("content", "status"),
    [
        (b"", 422),
        (b"{not json", 422),
        (b"[1, 2]", 422),
        (_score_body(token_ids="many"), 422),
        (_score_body(token_ids=[1, 2], block_keys=[3]), 422),
        (_score_body(token_ids=[-1]), 422),
        (msgspec.json.encode({"model": "nope", "token_ids": [1, 2]}), 404),
        (_score_body(token_ids=list(range(2000))), 413),
    ],
)
def test_a_bad_score_request_gets_the_same_error(
    twins: tuple[Api, Api], content: bytes, status: int
) -> None:
    answer = same_answer(twins, "POST", "/score", content=content)
    assert answer.status_code == status, answer.text
    assert set(msgspec.json.decode(answer.content)) == {"error", "detail"}


def test_other_methods_and_paths_are_left_to_fastapi(twins: tuple[Api, Api]) -> None:
    assert same_answer(twins, "GET", "/score").status_code == 405
    assert same_answer(twins, "PUT", "/score", content=_score_body()).status_code == 405
    assert same_answer(twins, "POST", "/healthz").status_code == 405
    assert same_answer(twins, "GET", "/healthz").status_code == 200
    same_answer(twins, "HEAD", "/healthz")
    assert same_answer(twins, "GET", "/score/extra").status_code == 404


def test_the_token_is_checked_before_the_body_is_read(guarded_twins: tuple[Api, Api]) -> None:
    body = _score_body(token_ids=tokens(1_000, 8))
    refused = same_answer(guarded_twins, "POST", "/score", content=body)
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"] == 'Bearer realm="kvindex"'
    wrong = {"authorization": f"Bearer {TOKEN}x"}
    refused = same_answer(guarded_twins, "POST", "/score", content=body, headers=wrong)
    assert refused.status_code == 401
    too_large = _score_body(token_ids=list(range(2000)))  # unread: 401, not 413
    assert same_answer(guarded_twins, "POST", "/score", content=too_large).status_code == 401
    right = {"authorization": f"Bearer {TOKEN}"}
    served = same_answer(guarded_twins, "POST", "/score", content=body, headers=right)
    assert served.status_code == 200
    assert same_answer(guarded_twins, "GET", "/healthz").status_code == 200  # never guarded


def _requests_total(api: Api) -> dict[tuple[str, str, str], float]:
    text = api.get("/metrics").text
    families = text_string_to_metric_families(text)
    (family,) = [f for f in families if f.name == "kvindex_http_requests"]
    return {
        (s.labels["route"], s.labels["method"], s.labels["status"]): s.value
        for s in family.samples
        if s.name == "kvindex_http_requests_total"
    }


def test_the_traffic_metrics_count_hot_requests_under_their_route(twins: tuple[Api, Api]) -> None:
    for _ in range(2):
        same_answer(twins, "POST", "/score", content=_score_body(token_ids=tokens(1_000, 2)))
    same_answer(twins, "POST", "/score", content=b"{")
    same_answer(twins, "GET", "/healthz")
    lean, framework = (_requests_total(api) for api in twins)
    assert lean[("/score", "POST", "200")] == 2
    assert lean[("/score", "POST", "422")] == 1
    assert lean[("/healthz", "GET", "200")] == 1
    assert lean == framework


def test_the_openapi_document_is_unchanged(twins: tuple[Api, Api]) -> None:
    document = same_answer(twins, "GET", "/openapi.json")
    assert "post" in msgspec.json.decode(document.content)["paths"]["/score"]


def test_a_chunked_score_body_is_bounded_alike(twins: tuple[Api, Api]) -> None:
    """A body without a declared length, counted as it comes: over the limit, 413."""

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "demo-model", "token_ids": [1'
        for _ in range(2000):
            yield b", 1"
        yield b"]}"

    lean, framework = (api.runner.run(api.client.post("/score", content=chunks())) for api in twins)
    assert lean.status_code == framework.status_code == 413
    assert lean.content == framework.content
    assert lean.headers["connection"] == framework.headers["connection"] == "close"
