"""kvindex.api.tokenize.choice: which route a model's setting names, the spec of a
``tokenizer.json``, build_tokenizer, and the local tokenizer of each model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import tokenizers

from kvindex.api.config.settings import ApiSettings, ModelSpec
from kvindex.api.tokenize.cache import CachingTokenizer
from kvindex.api.tokenize.choice import (
    LocalTokenizers,
    TokenizerSpec,
    build_tokenizer,
    replica_route,
)
from kvindex.api.tokenize.local import LocalTokenizer
from kvindex.api.tokenize.protocol import TokenizerError
from tests.unit.api.tokenize.samples import CONVERSATION, make_tokenizer


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"path": ""}, "path"),
        ({"path": "t.json", "cache_entries": -1}, "cache_entries"),
        ({"path": "t.json", "cache_bytes": 0}, "cache_bytes"),
        ({"path": "t.json", "prefix_cache_bytes": -1}, "prefix_cache_bytes"),
    ],
)
def test_spec_errors_name_the_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(TokenizerError, match=rf"^{field}\b"):
        TokenizerSpec(**fields)


def test_build_is_cached(model_dir: Path, raw: tokenizers.Tokenizer) -> None:
    tok = build_tokenizer(TokenizerSpec(str(model_dir / "tokenizer.json"), cache_entries=8))
    assert isinstance(tok, CachingTokenizer)
    assert isinstance(tok.inner, LocalTokenizer)
    assert tok.max_entries == 8

    async def main() -> None:
        first = await tok.encode_messages(CONVERSATION)
        assert await tok.encode_messages(CONVERSATION) == first

    asyncio.run(main())
    assert tok.num_hits == 1


def test_build_with_template_path(tmp_path: Path) -> None:
    make_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "t.jinja").write_text("<|user|>")
    spec = TokenizerSpec(
        str(tmp_path / "tokenizer.json"),
        chat_template_path=str(tmp_path / "t.jinja"),
        cache_entries=0,
    )
    tok = build_tokenizer(spec)
    assert isinstance(tok, LocalTokenizer)
    assert len(asyncio.run(tok.encode_messages([]))) == 1


def test_build_with_bad_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="tokenizer file"):
        build_tokenizer(TokenizerSpec(str(tmp_path / "tokenizer.json")))


def test_a_configured_file_is_built_once_with_the_settings_caches(model_dir: Path) -> None:
    path = str(model_dir / "tokenizer.json")
    settings = ApiSettings(
        models=(ModelSpec("m", tokenizer=path),),
        tokenizer_cache_entries=8,
        tokenizer_cache_bytes=4096,
        tokenizer_prefix_cache_bytes=0,
    )
    local = LocalTokenizers(settings)
    assert local.spec("m") == TokenizerSpec(
        path, cache_entries=8, cache_bytes=4096, prefix_cache_bytes=0
    )
    tok = local.tokenizer("m")
    assert isinstance(tok, CachingTokenizer)
    assert (tok.max_entries, tok.max_bytes) == (8, 4096)
    assert isinstance(tok.inner, LocalTokenizer)
    assert local.tokenizer("m") is tok  # built once
    local.forget("m")
    local.forget("never-asked")
    assert local.tokenizer("m") is not tok


@pytest.mark.parametrize("configured", [None, "replica", "render", "tokenize"])
def test_a_model_tokenized_by_its_replicas_has_no_local_tokenizer(configured: str | None) -> None:
    local = LocalTokenizers(ApiSettings(models=(ModelSpec("m", tokenizer=configured),)))
    assert local.spec("m") is None and local.tokenizer("m") is None
    assert local.tokenizer("unconfigured") is None


def test_a_failed_build_is_tried_again(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    settings = ApiSettings(models=(ModelSpec("m", tokenizer=str(path)),), tokenizer_cache_entries=0)
    local = LocalTokenizers(settings)
    with pytest.raises(TokenizerError, match="tokenizer file"):
        local.tokenizer("m")
    make_tokenizer().save(str(path))
    assert isinstance(local.tokenizer("m"), LocalTokenizer)


@pytest.mark.parametrize(
    ("configured", "route"),
    [(None, "auto"), ("replica", "auto"), ("render", "render"), ("tokenize", "tokenize")],
)
def test_the_tokenizer_setting_names_the_replica_route(configured: str | None, route: str) -> None:
    assert replica_route(configured) == route


def test_any_other_tokenizer_setting_is_a_path() -> None:
    assert replica_route("/models/m/tokenizer.json") is None
    assert replica_route("Render") is None
