"""kvindex.api.tokenize.replica: the render routes, and the choice of route a replica gets
(``auto`` learns it, and asks render again after ``reprobe_s``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from kvindex.api.tokenize.protocol import TokenizerError
from kvindex.api.tokenize.replica import ReplicaRoute, ReplicaTokenizer
from tests.unit.api.tokenize.samples import CONVERSATION

BASE = "http://replica:8000"
COMPLETIONS_RENDER = f"{BASE}/v1/completions/render"
CHAT_RENDER = f"{BASE}/v1/chat/completions/render"
TOKENIZE = f"{BASE}/tokenize"


def generate_request(tokens: list[int]) -> dict[str, Any]:
    """One GenerateRequest as vLLM's render routes answer it."""
    return {
        "request_id": "render-1",
        "token_ids": tokens,
        "features": None,
        "sampling_params": {"max_tokens": 16, "temperature": 1.0},
        "model": "m1",
        "stream": False,
        "cache_salt": None,
        "priority": 0,
        "kv_transfer_params": None,
    }


class FakeReplica:
    """Answers the render routes (when ``render_status`` is 200) and ``/tokenize``; records
    every request's URL and JSON body."""

    def __init__(self, render_status: int = 200, tokens: list[int] | None = None) -> None:
        self.render_status = render_status
        self.tokens = [5, 6, 7] if tokens is None else tokens
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        url = str(request.url)
        self.seen.append((url, json.loads(request.content)))
        if url == TOKENIZE:
            return httpx.Response(200, json={"count": 2, "tokens": [1, 2], "max_model_len": 9})
        if self.render_status != 200:
            return httpx.Response(self.render_status, json={"detail": "Not Found"})
        rendered = generate_request(self.tokens)
        return httpx.Response(200, json=rendered if url == CHAT_RENDER else [rendered])

    def urls(self) -> list[str]:
        return [url for url, _ in self.seen]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(
    handler: Callable[[httpx.Request], httpx.Response],
    calls: Callable[[ReplicaTokenizer, Clock], Awaitable[Any]],
    route: ReplicaRoute = "auto",
) -> Any:
    async def main() -> Any:
        clock = Clock()
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            tokenizer = ReplicaTokenizer(
                client, BASE + "/", "m1", timeout_s=2, route=route, reprobe_s=30, clock=clock
            )
            return await calls(tokenizer, clock)

    return asyncio.run(main())


def test_render_served_completions_asks_it_alone() -> None:
    replica = FakeReplica()
    assert run(replica, lambda t, _: t.encode_prompt("hello world")) == [5, 6, 7]
    assert replica.seen == [
        (COMPLETIONS_RENDER, {"model": "m1", "prompt": "hello world", "add_special_tokens": True})
    ]


def test_render_served_chat_asks_it_alone() -> None:
    replica = FakeReplica()
    assert run(replica, lambda t, _: t.encode_messages(CONVERSATION)) == [5, 6, 7]
    assert replica.seen == [
        (
            CHAT_RENDER,
            {
                "model": "m1",
                "messages": CONVERSATION,
                "add_generation_prompt": True,
                "add_special_tokens": False,
            },
        )
    ]


def test_render_request_is_framed_by_its_length() -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return FakeReplica()(request)

    run(handler, lambda t, _: t.encode_prompt("a"))
    assert sent[0].headers["content-length"] == str(len(sent[0].content))
    assert "transfer-encoding" not in sent[0].headers


@pytest.mark.parametrize("status", [401, 403, 404, 405, 501])
def test_render_not_served_falls_back_in_the_same_call(status: int) -> None:
    replica = FakeReplica(render_status=status)
    assert run(replica, lambda t, _: t.encode_prompt("a")) == [1, 2]
    assert replica.urls() == [COMPLETIONS_RENDER, TOKENIZE]
    assert replica.seen[0][1] == replica.seen[1][1]  # the same body to both


def test_not_served_is_remembered_then_render_asked_again_after_reprobe_s() -> None:
    replica = FakeReplica(render_status=404)

    async def calls(tokenizer: ReplicaTokenizer, clock: Clock) -> list[bool]:
        uses = [tokenizer.uses_render()]
        await tokenizer.encode_prompt("a")
        uses.append(tokenizer.uses_render())
        clock.now += 29.9
        await tokenizer.encode_messages(CONVERSATION)  # /tokenize alone
        clock.now += 0.1
        uses.append(tokenizer.uses_render())
        replica.render_status = 200  # the replica restarted with --enable-scale-out
        assert await tokenizer.encode_prompt("a") == [5, 6, 7]
        uses.append(tokenizer.uses_render())
        return uses

    assert run(replica, calls) == [True, False, True, True]
    assert replica.urls() == [COMPLETIONS_RENDER, TOKENIZE, TOKENIZE, COMPLETIONS_RENDER]


@pytest.mark.parametrize("status", [400, 500, 503])
def test_render_failing_otherwise_is_an_error_not_a_fallback(status: int) -> None:
    replica = FakeReplica(render_status=status)
    with pytest.raises(TokenizerError, match=f"{COMPLETIONS_RENDER}: HTTP {status}"):
        run(replica, lambda t, _: t.encode_prompt("a"))
    assert replica.urls() == [COMPLETIONS_RENDER]


def test_route_render_never_falls_back() -> None:
    replica = FakeReplica(render_status=404)
    with pytest.raises(TokenizerError, match=r"HTTP 404 .*--enable-scale-out"):
        run(replica, lambda t, _: t.encode_prompt("a"), route="render")
    assert replica.urls() == [COMPLETIONS_RENDER]


def test_route_tokenize_never_asks_render() -> None:
    replica = FakeReplica()

    async def calls(tokenizer: ReplicaTokenizer, _: Clock) -> list[list[int]]:
        return [await tokenizer.encode_prompt("a"), await tokenizer.encode_messages(CONVERSATION)]

    assert run(replica, calls, route="tokenize") == [[1, 2], [1, 2]]
    assert replica.urls() == [TOKENIZE, TOKENIZE]


def test_an_unknown_route_is_refused() -> None:
    async def build() -> None:
        async with httpx.AsyncClient() as client:
            ReplicaTokenizer(client, BASE, "m1", route="both")  # type: ignore[arg-type]

    with pytest.raises(TokenizerError, match="route must be one of"):
        asyncio.run(build())


@pytest.mark.parametrize(
    "body",
    [
        b"[]",
        json.dumps([generate_request([1]), generate_request([2])]).encode(),
        b'[{"request_id": "x"}]',
        b'[{"token_ids": [-1]}]',
        b'[{"token_ids": [4294967296]}]',
        b'{"tokens": [1, 2]}',
        b"not json",
    ],
)
def test_malformed_render_answers(body: bytes) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body)

    with pytest.raises(TokenizerError, match=COMPLETIONS_RENDER):
        run(handler, lambda t, _: t.encode_prompt("a"))


def test_an_object_answers_completions_too() -> None:
    """A renderer answering one object for a completions prompt (as a standalone one may)."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"token_ids": [9, 8]})

    assert run(handler, lambda t, _: t.encode_prompt("a")) == [9, 8]
