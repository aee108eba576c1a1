"""The proxy's tokenizers: a model tokenized by replicas survives its first replica's death."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest

from kvindex.api.config.settings import ApiSettings, ModelSpec
from kvindex.api.health.routing import health_policy
from kvindex.api.tokenize.cache import CachingTokenizer
from kvindex.api.tokenize.failover import FailoverTokenizer, FleetTokenizers
from kvindex.api.tokenize.local import LocalTokenizer
from kvindex.api.tokenize.protocol import TokenizerError
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec

MODEL = "m"


class Replicas:
    """``/tokenize`` of r1..r4 (a token a word, or a message: 1, 9 on the ``odd`` ones), no
    render routes (404, not counted in ``asked``); ``down`` ones refuse connections."""

    def __init__(self, *down: str, odd: tuple[str, ...] = ()) -> None:
        self.down = set(down)
        self.odd = set(odd)
        self.asked: list[str] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        replica = request.url.host
        render = request.url.path.endswith("/render")
        if replica in self.down or not render:
            self.asked.append(replica)
        if replica in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if render:
            return httpx.Response(404, json={"detail": "Not Found"})
        body = json.loads(request.content)
        parts = body["prompt"].split() if "prompt" in body else body["messages"]
        return httpx.Response(200, json={"tokens": [9 if replica in self.odd else 1] * len(parts)})


def _registry() -> Registry:
    specs = [ReplicaSpec(f"r{i}", MODEL, url=f"http://r{i}:8000") for i in (1, 2, 3, 4)]
    return Registry((*specs, ReplicaSpec("other", "n", url="http://other:8000")))


def test_a_dead_first_replica_is_skipped_and_the_others_are_asked_in_turn_once_vetted() -> None:
    """r1 is down: r2 answers first and is the reference; r3 and r4 agree with it, r1's probe
    fails (unvetted: asked only after them), and the odd r4 is never asked again."""
    replicas = Replicas("r1", odd=("r4",))

    async def run() -> FailoverTokenizer:
        async with httpx.AsyncClient(transport=httpx.MockTransport(replicas.handle)) as client:
            tokenizer = FailoverTokenizer(MODEL, _registry(), client, timeout_s=1)
            assert await tokenizer.encode_prompt("a b") == [1, 1]
            assert replicas.asked == ["r1", "r2"]
            assert await tokenizer.encode_prompt("c") == [1]  # r2 again: the others unvetted
            round_ = tokenizer.renderers._round
            assert round_ is not None
            await round_
            replicas.asked.clear()
            for _ in range(4):
                assert await tokenizer.encode_prompt("d e f") == [1, 1, 1]
            await tokenizer.aclose()
            return tokenizer

    tokenizer = asyncio.run(run())
    assert sorted(replicas.asked) == ["r2", "r2", "r3", "r3"]
    assert tokenizer.renderers.verdicts() == {"agrees": 2, "differs": 1, "unvetted": 1}
    assert tokenizer.renderers.num_answers == {"r2": 4, "r3": 2}


def test_at_most_three_replicas_are_asked_and_every_failure_is_named() -> None:
    replicas = Replicas("r1", "r2", "r3", "r4")

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(replicas.handle)) as client:
            tokenizer = FailoverTokenizer(MODEL, _registry(), client, timeout_s=1)
            await tokenizer.encode_prompt("a")

    with pytest.raises(TokenizerError, match=r"replica r1: .*r1:8000.*replica r2: .*r3:8000"):
        asyncio.run(run())
    assert replicas.asked == ["r1", "r2", "r3"]


def test_the_rule_local_file_or_failover_with_the_cache_in_front() -> None:
    replicas = Replicas("r1")
    settings = ApiSettings(models=(ModelSpec("n", tokenizer="/no/such/tokenizer.json"),))

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(replicas.handle)) as client:
            tokenizers = FleetTokenizers(settings, _registry(), client)
            tokenizer = tokenizers.tokenizer(MODEL)
            assert tokenizer is not None and tokenizers.tokenizer(MODEL) is tokenizer
            assert await tokenizer.encode_prompt("x y") == [1, 1]
            assert await tokenizer.encode_prompt("x y") == [1, 1]  # cached: not asked again
            with pytest.raises(TokenizerError, match=re.escape("tokenizer.json")):
                tokenizers.tokenizer("n")  # a local file, built as the API does
            (renderers,) = tokenizers.renderers()
            assert renderers.num_answers == {"r2": 1}  # the second from the cache
            await tokenizers.aclose()

    asyncio.run(run())
    assert replicas.asked[:2] == ["r1", "r2"]


@pytest.mark.parametrize("replicas_tokenize", ["alike", "otherwise"])
def test_a_model_with_no_tokenizer_set_uses_the_hub_caches_file_while_its_replicas_agree(
    tmp_path: Path, model_dir: Path, replicas_tokenize: str
) -> None:
    """``m`` is in the hub cache: tokenized in process at once, its replicas asked the probe
    once; if they tokenize otherwise, they tokenize ``m`` from then on. ``n`` is not in the
    hub: its replicas tokenize it as before."""
    snapshot = tmp_path / "hub" / "models--m" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (snapshot / name).write_bytes((model_dir / name).read_bytes())
    files = LocalTokenizer.from_files(snapshot / "tokenizer.json", prefix_cache_bytes=0)
    replicas = Replicas()
    asked: list[str] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "other" or replicas_tokenize == "otherwise":
            return await replicas.handle(request)
        asked.append(request.url.host)
        if request.url.path.endswith("/render"):
            return httpx.Response(404, json={"detail": "Not Found"})
        body = json.loads(request.content)
        if "prompt" in body:
            return httpx.Response(200, json={"tokens": await files.encode_prompt(body["prompt"])})
        return httpx.Response(200, json={"tokens": await files.encode_messages(body["messages"])})

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
            tokenizers = FleetTokenizers(
                ApiSettings(hf_hub_cache=str(tmp_path / "hub")), _registry(), client
            )
            local = tokenizers.tokenizer(MODEL)
            assert isinstance(local, CachingTokenizer) and isinstance(local.inner, LocalTokenizer)
            assert await local.encode_prompt("x y")
            for _ in range(100):  # the check's calls answer at once
                if tokenizers.tokenizer(MODEL) is not local:
                    break
                await asyncio.sleep(0.01)
            now = tokenizers.tokenizer(MODEL)
            assert (now is local) == (replicas_tokenize == "alike")
            replicated = tokenizers.tokenizer("n")
            assert replicated is not None and await replicated.encode_prompt("x y") == [1, 1]
            await tokenizers.aclose()

    asyncio.run(run())
    if replicas_tokenize == "alike":  # the probe, once (a prompt and a chat), from m's replicas
        assert len([h for h in asked if h.startswith("r")]) >= 2
    assert "other" in replicas.asked


def test_each_replica_keeps_its_route_and_the_configured_route_is_used() -> None:
    """r1 serves render, r2 does not: each learns its own; ``tokenize`` never asks render."""
    paths: list[str] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        paths.append(f"{request.url.host}{request.url.path}")
        if request.url.path.endswith("/render"):
            if request.url.host != "r1":
                return httpx.Response(404, json={"detail": "Not Found"})
            return httpx.Response(200, json=[{"token_ids": [1], "sampling_params": {}}])
        return httpx.Response(200, json={"tokens": [2]})

    async def run(route: str) -> list[list[int]]:
        settings = ApiSettings(models=(ModelSpec(MODEL, tokenizer=route),))
        registry = Registry(
            (
                ReplicaSpec("r1", MODEL, url="http://r1:8000"),
                ReplicaSpec("r2", MODEL, url="http://r2:8000"),
            )
        )
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
            tokenizer = FleetTokenizers(settings, registry, client).tokenizer(MODEL)
            assert isinstance(tokenizer, CachingTokenizer)
            inner = tokenizer.inner
            assert isinstance(inner, FailoverTokenizer)
            first = await inner.encode_prompt("a")
            registry.remove("r1")
            return [first, await inner.encode_prompt("b"), await inner.encode_prompt("c")]

    assert asyncio.run(run("replica")) == [[1], [2], [2]]
    assert paths == [
        "r1/v1/completions/render",
        "r2/v1/completions/render",
        "r2/tokenize",
        "r2/tokenize",
    ]
    paths.clear()
    assert asyncio.run(run("tokenize")) == [[2], [2], [2]]
    assert paths == ["r1/tokenize", "r2/tokenize", "r2/tokenize"]


def test_an_ejected_replica_is_asked_only_after_the_others() -> None:
    replicas = Replicas()

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(replicas.handle)) as client:
            tokenizer = FailoverTokenizer(
                MODEL, _registry(), client, timeout_s=1, ejected=lambda: {"r1"}
            )
            for _ in range(3):
                assert await tokenizer.encode_prompt("a") == [1]
            await tokenizer.aclose()

    asyncio.run(run())
    assert replicas.asked[0] == "r2" and "r1" not in replicas.asked[:3]


@pytest.mark.parametrize(
    ("configured", "route"),
    [(None, "auto"), ("replica", "auto"), ("render", "render"), ("tokenize", "tokenize")],
)
def test_a_model_without_a_file_is_tokenized_by_its_replicas_on_the_route_named(
    configured: str | None, route: str
) -> None:
    async def run() -> None:
        settings = ApiSettings(models=(ModelSpec(MODEL, tokenizer=configured),))
        async with httpx.AsyncClient(transport=httpx.MockTransport(Replicas().handle)) as client:
            tokenizers = FleetTokenizers(settings, _registry(), client)
            tokenizer = tokenizers.tokenizer(MODEL)
            assert isinstance(tokenizer, CachingTokenizer)
            assert isinstance(tokenizer.inner, FailoverTokenizer)
            assert tokenizer.inner._route == route
            assert tokenizers.tokenizer(MODEL) is tokenizer
            await tokenizers.aclose()

    asyncio.run(run())


def test_a_replica_the_health_checks_ejected_is_asked_after_the_others() -> None:
    replicas = Replicas()
    settings = ApiSettings(unhealthy_threshold=1)
    registry, policy, now = _registry(), health_policy(settings), time.time()
    registry.update_health({"r1": lambda h: h.after_check(False, "down", now, policy)})

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(replicas.handle)) as client:
            tokenizers = FleetTokenizers(settings, registry, client)
            tokenizer = tokenizers.tokenizer(MODEL)
            assert tokenizer is not None
            assert await tokenizer.encode_prompt("a b") == [1, 1]
            await tokenizers.aclose()

    asyncio.run(run())
    assert replicas.asked[0] == "r2"
