"""kvindex.api.tokenize.replica: ReplicaTokenizer against an ``httpx.MockTransport`` (its
``/tokenize`` here; the render routes and the choice between them in test_replica_render)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
import pytest

from kvindex.api.tokenize.protocol import TokenizerError
from kvindex.api.tokenize.replica import ReplicaRoute, ReplicaTokenizer
from tests.unit.api.tokenize.samples import CONVERSATION, Handler, ok

T = TypeVar("T")


def replica_call(
    handler: Handler,
    call: Callable[[ReplicaTokenizer], Awaitable[T]],
    route: ReplicaRoute = "tokenize",
) -> T:
    """Run ``call`` against a ReplicaTokenizer whose client is served by ``handler``."""

    async def main() -> T:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport) as client:
            tokenizer = ReplicaTokenizer(
                client, "http://replica:8000/", "m1", timeout_s=2, route=route
            )
            return await call(tokenizer)

    return asyncio.run(main())


def test_replica_prompt_request_shape() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return ok([1, 2, 3])(request)

    assert replica_call(handler, lambda t: t.encode_prompt("hello world")) == [1, 2, 3]
    (request,) = seen
    assert request.method == "POST"
    assert str(request.url) == "http://replica:8000/tokenize"
    assert request.headers["content-type"] == "application/json"
    # sent from a generator that lets go of it, yet framed by its length, not chunked
    assert request.headers["content-length"] == str(len(request.content))
    assert "transfer-encoding" not in request.headers
    body = json.loads(request.content)
    assert body == {"model": "m1", "prompt": "hello world", "add_special_tokens": True}


def test_replica_messages_request_shape() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return ok([7])(request)

    assert replica_call(handler, lambda t: t.encode_messages(CONVERSATION)) == [7]
    assert seen == [
        {
            "model": "m1",
            "messages": CONVERSATION,  # the whole conversation, in order
            "add_generation_prompt": True,
            "add_special_tokens": False,
        }
    ]


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (404, '{"object":"error","message":"The model `m1` does not exist.","code":404}'),
        (500, "Internal Server Error"),
        (400, "x" * 5000),
    ],
)
def test_replica_http_errors(status: int, body: str) -> None:
    with pytest.raises(TokenizerError) as info:
        replica_call(lambda _: httpx.Response(status, text=body), lambda t: t.encode_prompt("a"))
    message = str(info.value)
    assert f"HTTP {status}" in message
    assert "http://replica:8000/tokenize" in message
    assert body[:50] in message
    assert len(message) < 400  # an excerpt, not the whole body


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"<html>oops</html>", "malformed"),
        (b"", "malformed"),
        (b'{"count": 2}', "malformed"),
        (b'{"tokens": "1 2"}', "malformed"),
        (b'{"tokens": [1, "2"]}', "malformed"),
        (b'{"tokens": [1, 2.5]}', "malformed"),
        (b'{"tokens": [true]}', "malformed"),
        (b'{"tokens": [-1]}', "malformed"),
        (b'{"tokens": [4294967296]}', "malformed"),
        (b"[1, 2, 3]", "malformed"),
    ],
)
def test_replica_malformed_responses(body: bytes, match: str) -> None:
    with pytest.raises(TokenizerError, match=match):
        replica_call(lambda _: httpx.Response(200, content=body), lambda t: t.encode_prompt("a"))


def test_replica_empty_token_list_is_valid() -> None:
    assert replica_call(ok([]), lambda t: t.encode_prompt("")) == []


@pytest.mark.parametrize(
    ("exc", "match"),
    [
        (httpx.ConnectError("connection refused"), "unreachable"),
        (httpx.ReadTimeout("slow"), "timed out after 2"),
        (httpx.RemoteProtocolError("peer closed"), "unreachable"),
    ],
)
def test_replica_unreachable(exc: Exception, match: str) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    with pytest.raises(TokenizerError, match=match):
        replica_call(handler, lambda t: t.encode_prompt("a"))


def test_replica_messages_not_json() -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": object()}]
    with pytest.raises(TokenizerError, match="not JSON-serializable"):
        replica_call(ok([1]), lambda t: t.encode_messages(messages))
