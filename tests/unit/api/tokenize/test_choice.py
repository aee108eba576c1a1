"""kvindex.api.tokenize.choice: the spec, build_tokenizer, and the model → tokenizer rule."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import tokenizers

from kvindex.api.config.settings import ApiSettings, ModelSpec
from kvindex.api.health.routing import health_policy
from kvindex.api.tokenize.cache import CachingTokenizer
from kvindex.api.tokenize.choice import (
    ModelTokenizers,
    TokenizerSpec,
    build_tokenizer,
    replica_route,
)
from kvindex.api.tokenize.local import LocalTokenizer
from kvindex.api.tokenize.protocol import TokenizerError
from kvindex.api.tokenize.replica import ReplicaTokenizer
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from tests.support.clock import Clock
from tests.unit.api.tokenize.samples import CONVERSATION, make_tokenizer, ok


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"kind": "remote"}, "kind"),
        ({"kind": "local"}, "path"),
        ({"kind": "local", "path": ""}, "path"),
        ({"kind": "local", "path": "t.json", "base_url": "http://h"}, "base_url"),
        ({"kind": "local", "path": "t.json", "model": "m"}, "model"),
        ({"kind": "local", "path": "t.json", "cache_entries": -1}, "cache_entries"),
        ({"kind": "local", "path": "t.json", "cache_bytes": 0}, "cache_bytes"),
        ({"kind": "replica", "model": "m"}, "base_url"),
        ({"kind": "replica", "base_url": "tcp://h:1", "model": "m"}, "base_url"),
        ({"kind": "replica", "base_url": "http://h"}, "model"),
        ({"kind": "replica", "base_url": "http://h", "model": "m", "timeout_s": 0}, "timeout_s"),
        ({"kind": "replica", "base_url": "http://h", "model": "m", "path": "t"}, "path"),
        (
            {"kind": "replica", "base_url": "http://h", "model": "m", "chat_template_path": "t"},
            "chat_template_path",
        ),
    ],
)
def test_spec_errors_name_the_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(TokenizerError, match=rf"^{field}\b"):
        TokenizerSpec(**fields)


def test_build_local_is_cached(model_dir: Path, raw: tokenizers.Tokenizer) -> None:
    spec = TokenizerSpec(kind="local", path=str(model_dir / "tokenizer.json"), cache_entries=8)

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            tok = build_tokenizer(spec, client)
            assert isinstance(tok, CachingTokenizer)
            assert isinstance(tok.inner, LocalTokenizer)
            assert tok.max_entries == 8
            assert await tok.encode_messages(CONVERSATION) == await tok.encode_messages(
                CONVERSATION
            )
            assert tok.num_hits == 1

    asyncio.run(main())


def test_build_local_with_template_path(tmp_path: Path) -> None:
    make_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "t.jinja").write_text("<|user|>")
    spec = TokenizerSpec(
        kind="local",
        path=str(tmp_path / "tokenizer.json"),
        chat_template_path=str(tmp_path / "t.jinja"),
        cache_entries=0,
    )

    async def main() -> list[int]:
        async with httpx.AsyncClient() as client:
            tok = build_tokenizer(spec, client)
            assert isinstance(tok, LocalTokenizer)
            return await tok.encode_messages([])

    assert len(asyncio.run(main())) == 1


def test_build_local_with_bad_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    spec = TokenizerSpec(kind="local", path=str(tmp_path / "tokenizer.json"))

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            build_tokenizer(spec, client)

    with pytest.raises(TokenizerError, match="tokenizer file"):
        asyncio.run(main())


def test_build_replica_uses_the_given_client() -> None:
    spec = TokenizerSpec(kind="replica", base_url="http://r:8000", model="m1", timeout_s=1.5)

    async def main() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(ok([4, 5]))) as client:
            tok = build_tokenizer(spec, client)
            assert isinstance(tok, CachingTokenizer)
            inner = tok.inner
            assert isinstance(inner, ReplicaTokenizer)
            assert (inner.client, inner.url, inner.model, inner.timeout_s) == (
                client,
                "http://r:8000/tokenize",
                "m1",
                1.5,
            )
            return await tok.encode_prompt("x")

    assert asyncio.run(main()) == [4, 5]


# --- ModelTokenizers: the model → tokenizer rule --------------------------------------------


def model_tokenizers(
    registry: Registry, *models: ModelSpec, **settings: Any
) -> tuple[ModelTokenizers, httpx.AsyncClient]:
    client = httpx.AsyncClient(transport=httpx.MockTransport(ok([4, 5])))
    return ModelTokenizers(ApiSettings(models=models, **settings), registry, client), client


def test_a_configured_file_wins_over_replicas(model_dir: Path) -> None:
    path = str(model_dir / "tokenizer.json")
    registry = Registry((ReplicaSpec("a", "m", url="http://a:8000"),))
    chooser, client = model_tokenizers(
        registry,
        ModelSpec("m", tokenizer=path),
        tokenizer_cache_entries=8,
        tokenizer_cache_bytes=4096,
    )
    expected = TokenizerSpec(kind="local", path=path, cache_entries=8, cache_bytes=4096)
    assert chooser.spec("m") == expected
    tok = chooser.tokenizer("m")
    assert isinstance(tok, CachingTokenizer)
    assert (tok.max_entries, tok.max_bytes) == (8, 4096)
    assert isinstance(tok.inner, LocalTokenizer)
    assert chooser.tokenizer("m") is tok  # built once
    asyncio.run(client.aclose())


@pytest.mark.parametrize(
    "configured", [(), (ModelSpec("m", tokenizer="replica"),), (ModelSpec("m"),)]
)
def test_else_the_first_replica_of_the_model_with_a_url(configured: tuple[ModelSpec, ...]) -> None:
    registry = Registry(
        (
            ReplicaSpec("a", "m"),
            ReplicaSpec("b", "other", url="http://b:8000"),
            ReplicaSpec("c", "m", url="http://c:8000"),
            ReplicaSpec("d", "m", url="http://d:8000"),
        )
    )
    chooser, client = model_tokenizers(registry, *configured, scrape_timeout_s=0.25)
    assert chooser.spec("m") == TokenizerSpec(
        kind="replica", base_url="http://c:8000", model="m", timeout_s=0.25, cache_entries=4096
    )
    tok = chooser.tokenizer("m")
    assert isinstance(tok, CachingTokenizer)
    assert asyncio.run(tok.encode_prompt("x")) == [4, 5]
    asyncio.run(client.aclose())


def test_no_tokenizer_is_kept_until_forget() -> None:
    registry = Registry((ReplicaSpec("a", "m"),))
    chooser, client = model_tokenizers(registry)
    assert chooser.tokenizer("m") is None
    registry.add(ReplicaSpec("b", "m", url="http://b:8000"))
    assert chooser.tokenizer("m") is None  # kept: the app forgets on registration
    chooser.forget("m")
    chooser.forget("never-asked")
    assert isinstance(chooser.tokenizer("m"), CachingTokenizer)
    asyncio.run(client.aclose())


def test_a_failed_build_is_tried_again(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    chooser, client = model_tokenizers(
        Registry(), ModelSpec("m", tokenizer=str(path)), tokenizer_cache_entries=0
    )
    with pytest.raises(TokenizerError, match="tokenizer file"):
        chooser.tokenizer("m")
    make_tokenizer().save(str(path))
    assert isinstance(chooser.tokenizer("m"), LocalTokenizer)
    asyncio.run(client.aclose())


def test_an_ejected_replica_is_not_asked_to_tokenize() -> None:
    clock = Clock()
    specs = (ReplicaSpec("a", "m", url="http://a:8000"), ReplicaSpec("b", "m", url="http://b:8000"))
    registry = Registry(specs, clock=clock)
    settings = ApiSettings(unhealthy_threshold=1)
    client = httpx.AsyncClient(transport=httpx.MockTransport(ok([4, 5])))
    chooser = ModelTokenizers(settings, registry, client, clock=clock)
    first = chooser.tokenizer("m")
    assert chooser.spec("m") == TokenizerSpec(
        kind="replica", base_url="http://a:8000", model="m", timeout_s=1.0, cache_entries=4096
    )
    policy = health_policy(settings)
    now = clock.now
    registry.update_health({"a": lambda h: h.after_check(False, "down", now, policy)})
    assert chooser.tokenizer("m") is first  # looked at again within a second at most
    clock.now += 1.0
    second = chooser.tokenizer("m")
    assert second is not first and chooser.spec("m") is not None
    assert chooser.spec("m").base_url == "http://b:8000"  # type: ignore[union-attr]
    registry.update_health({"b": lambda h: h.after_check(False, "down", now, policy)})
    clock.now += 1.0
    assert chooser.tokenizer("m") is second  # every one ejected: the one it has is kept
    asyncio.run(client.aclose())


@pytest.mark.parametrize(
    ("configured", "route"),
    [(None, "auto"), ("replica", "auto"), ("render", "render"), ("tokenize", "tokenize")],
)
def test_the_tokenizer_setting_names_the_replica_route(configured: str | None, route: str) -> None:
    assert replica_route(configured) == route
    registry = Registry((ReplicaSpec("a", "m", url="http://a:8000"),))
    chooser, client = model_tokenizers(registry, ModelSpec("m", tokenizer=configured))
    spec = chooser.spec("m")
    assert spec is not None and (spec.kind, spec.route) == ("replica", route)
    tok = chooser.tokenizer("m")
    assert isinstance(tok, CachingTokenizer) and isinstance(tok.inner, ReplicaTokenizer)
    assert tok.inner.route == route
    asyncio.run(client.aclose())


def test_any_other_tokenizer_setting_is_a_path() -> None:
    assert replica_route("/models/m/tokenizer.json") is None
    assert replica_route("Render") is None
    with pytest.raises(TokenizerError, match="route must be one of"):
        TokenizerSpec(kind="replica", base_url="http://h", model="m", route="both")  # type: ignore[arg-type]
