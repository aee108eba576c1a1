"""The proxy's tokenizers: a model tokenized by replicas survives its first replica's death."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from kvindex.api.config.settings import ApiSettings, ModelSpec
from kvindex.api.tokenize.failover import FailoverTokenizer, ProxyTokenizers
from kvindex.api.tokenize.protocol import TokenizerError
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec

MODEL = "m"


class Replicas:
    """``/tokenize`` of r1..r4 (one token per word plus the replica's number); ``down``
    ones refuse connections."""

    def __init__(self, *down: str) -> None:
        self.down = set(down)
        self.asked: list[str] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        replica = request.url.host
        self.asked.append(replica)
        if replica in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        words = json.loads(request.content)["prompt"].split()
        return httpx.Response(200, json={"tokens": [int(replica[1:])] * len(words)})


def _registry() -> Registry:
    specs = [ReplicaSpec(f"r{i}", MODEL, url=f"http://r{i}:8000") for i in (1, 2, 3, 4)]
    return Registry((*specs, ReplicaSpec("other", "n", url="http://other:8000")))


def test_a_dead_first_replica_is_skipped_and_the_one_that_answered_is_asked_first() -> None:
    replicas = Replicas("r1")

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(replicas.handle)) as client:
            tokenizer = FailoverTokenizer(MODEL, _registry(), client, timeout_s=1)
            first = await tokenizer.encode_prompt("a b")
            second = await tokenizer.encode_prompt("c d e")
            return [first, second]

    assert asyncio.run(run()) == [[2, 2], [2, 2, 2]]
    assert replicas.asked == ["r1", "r2", "r2"]  # r2 answered: asked first from then on


def test_at_most_three_replicas_are_asked_and_every_failure_is_named() -> None:
    replicas = Replicas("r1", "r2", "r3", "r4")

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(replicas.handle)) as client:
            tokenizer = FailoverTokenizer(MODEL, _registry(), client, timeout_s=1)
            await tokenizer.encode_prompt("a")

    with pytest.raises(TokenizerError, match=r"r1:8000.*r2:8000.*r3:8000"):
        asyncio.run(run())
    assert replicas.asked == ["r1", "r2", "r3"]


def test_the_rule_local_file_or_failover_with_the_cache_in_front() -> None:
    replicas = Replicas("r1")
    settings = ApiSettings(models=(ModelSpec("n", tokenizer="/no/such/tokenizer.json"),))

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(replicas.handle)) as client:
            tokenizers = ProxyTokenizers(settings, _registry(), client)
            tokenizer = tokenizers.tokenizer(MODEL)
            assert tokenizer is not None and tokenizers.tokenizer(MODEL) is tokenizer
            assert await tokenizer.encode_prompt("x y") == [2, 2]
            assert await tokenizer.encode_prompt("x y") == [2, 2]  # cached: not asked again
            with pytest.raises(TokenizerError, match=re.escape("tokenizer.json")):
                tokenizers.tokenizer("n")  # a local file, built as the API does

    asyncio.run(run())
    assert replicas.asked == ["r1", "r2"]
