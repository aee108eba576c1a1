"""kvindex.api.tokenize over real HTTP: ReplicaTokenizer (+ cache) against a vLLM-shaped /tokenize.

The fixture serves a tiny FastAPI app with uvicorn on a free loopback port, in a background
thread, and stops it (``should_exit``, join) after the test. Its ``/tokenize`` follows vLLM's
request and response shapes; it "tokenizes" by splitting on whitespace into ints.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvindex.api.http.background import BackgroundServer
from kvindex.api.loop.probe import Probes
from kvindex.api.tokenize.cache import CachingTokenizer
from kvindex.api.tokenize.protocol import Tokenizer, TokenizerError
from kvindex.api.tokenize.replica import ReplicaTokenizer, TokenizeClient

T = TypeVar("T")
MODEL = "demo-model"
SLOW_MODEL = "slow-model"
BOS = 0
ROLE_IDS = {"system": 1, "user": 2, "assistant": 3}
MAX_MODEL_LEN = 4096


@dataclass
class FakeReplica:
    """What the fake replica received; ``base_url`` is where it listens."""

    base_url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)


def split_ints(text: str) -> list[int]:
    return [int(word) for word in text.split()]


def tokenize(body: dict[str, Any]) -> list[int]:
    """vLLM's semantics in miniature: BOS for prompts, role markers + generation prompt for chat."""
    if "messages" in body:
        tokens = [BOS] if body.get("add_special_tokens", False) else []
        for message in body["messages"]:
            tokens += [ROLE_IDS[message["role"]], *split_ints(message["content"])]
        return tokens + ([ROLE_IDS["assistant"]] if body.get("add_generation_prompt") else [])
    prefix = [BOS] if body.get("add_special_tokens", True) else []
    return prefix + split_ints(body["prompt"])


def replica_app(state: FakeReplica) -> FastAPI:
    app = FastAPI()

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        body = await request.json()
        state.bodies.append(body)
        if body.get("model") == SLOW_MODEL:
            await asyncio.sleep(0.5)
        elif body.get("model") != MODEL:
            message = f"The model `{body.get('model')}` does not exist."
            return JSONResponse({"object": "error", "message": message, "code": 404}, 404)
        tokens = tokenize(body)
        payload = {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens}
        return JSONResponse(payload)

    return app


@pytest.fixture
def replica() -> Iterator[FakeReplica]:
    """A real HTTP server on 127.0.0.1 (free port), stopped and joined after the test."""
    state = FakeReplica()
    server = BackgroundServer(replica_app(state), lifespan="off").start()
    state.base_url = server.base_url
    try:
        yield state
    finally:
        server.stop()
    assert not server.running, "the fake replica did not stop"


class WithClient(Protocol):
    def __call__(self, call: Callable[[TokenizeClient], Awaitable[T]]) -> T: ...


@pytest.fixture(params=["httpx", "probes"])
def with_client(request: pytest.FixtureRequest) -> WithClient:
    """Runs ``call`` with httpx's client, or with :class:`Probes` (the processes' own)."""

    def run(call: Callable[[TokenizeClient], Awaitable[T]]) -> T:
        async def main() -> T:
            async with httpx.AsyncClient() as http:
                if request.param == "httpx":
                    return await call(http)
                probes = Probes(http)
                try:
                    return await call(probes)
                finally:
                    await probes.aclose()

        return asyncio.run(main())

    return run


CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "11 12"},
    {"role": "user", "content": "21 22"},
    {"role": "assistant", "content": "31"},
    {"role": "user", "content": "41 42 43"},
]


def test_prompt_end_to_end(replica: FakeReplica, with_client: WithClient) -> None:
    async def call(client: TokenizeClient) -> list[int]:
        return await ReplicaTokenizer(client, replica.base_url, MODEL).encode_prompt("5 6 7")

    assert with_client(call) == [BOS, 5, 6, 7]
    assert replica.bodies == [{"model": MODEL, "prompt": "5 6 7", "add_special_tokens": True}]


def test_messages_end_to_end(replica: FakeReplica, with_client: WithClient) -> None:
    async def call(client: TokenizeClient) -> list[int]:
        tok = ReplicaTokenizer(client, replica.base_url, MODEL)
        return await tok.encode_messages(CONVERSATION)

    assert with_client(call) == [1, 11, 12, 2, 21, 22, 3, 31, 2, 41, 42, 43, 3]
    (body,) = replica.bodies
    assert body["messages"] == CONVERSATION
    assert body["add_generation_prompt"] is True
    assert body["add_special_tokens"] is False


def test_cache_avoids_second_request(replica: FakeReplica, with_client: WithClient) -> None:
    async def call(client: TokenizeClient) -> CachingTokenizer:
        tok = CachingTokenizer(ReplicaTokenizer(client, replica.base_url, MODEL))
        first = [await tok.encode_prompt("1 2"), await tok.encode_messages(CONVERSATION)]
        again = [await tok.encode_prompt("1 2"), await tok.encode_messages(CONVERSATION)]
        assert first == again
        concurrent = await asyncio.gather(*(tok.encode_prompt("9 9") for _ in range(5)))
        assert concurrent == [[BOS, 9, 9]] * 5
        return tok

    tok = with_client(call)
    assert len(replica.bodies) == 3  # "1 2", the conversation, "9 9" once
    assert (tok.num_misses, tok.num_hits) == (3, 6)


def test_later_message_change_is_a_new_request(
    replica: FakeReplica, with_client: WithClient
) -> None:
    changed = [*CONVERSATION[:-1], {"role": "user", "content": "44"}]

    async def call(client: TokenizeClient) -> list[list[int]]:
        tok: Tokenizer = CachingTokenizer(ReplicaTokenizer(client, replica.base_url, MODEL))
        return [await tok.encode_messages(CONVERSATION), await tok.encode_messages(changed)]

    first, second = with_client(call)
    assert first[-4:] == [41, 42, 43, 3]
    assert second[-2:] == [44, 3]
    assert len(replica.bodies) == 2


def test_unknown_model_is_a_tokenizer_error(replica: FakeReplica, with_client: WithClient) -> None:
    async def call(client: TokenizeClient) -> list[int]:
        return await ReplicaTokenizer(client, replica.base_url, "other").encode_prompt("1")

    with pytest.raises(TokenizerError, match=r"HTTP 404.*`other` does not exist"):
        with_client(call)


def test_wrong_path_is_a_tokenizer_error(replica: FakeReplica, with_client: WithClient) -> None:
    async def call(client: TokenizeClient) -> list[int]:
        return await ReplicaTokenizer(client, replica.base_url + "/v1", MODEL).encode_prompt("1")

    with pytest.raises(TokenizerError, match="HTTP 404"):
        with_client(call)


def test_timeout_is_a_tokenizer_error(replica: FakeReplica, with_client: WithClient) -> None:
    async def call(client: TokenizeClient) -> list[int]:
        tok = ReplicaTokenizer(client, replica.base_url, SLOW_MODEL, timeout_s=0.1)
        return await tok.encode_prompt("1")

    with pytest.raises(TokenizerError, match=r"timed out after 0\.1 s"):
        with_client(call)


def test_unreachable_is_a_tokenizer_error(with_client: WithClient) -> None:
    with socket.socket() as sock:  # a port nobody listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"

        async def call(client: TokenizeClient) -> list[int]:
            return await ReplicaTokenizer(client, url, MODEL, timeout_s=2).encode_prompt("1")

        with pytest.raises(TokenizerError, match="unreachable"):
            with_client(call)
