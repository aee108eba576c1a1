"""kvindex.api.tokenize.choice: which route a model's setting names, the spec of a
``tokenizer.json``, build_tokenizer, and the local tokenizer of each model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import tokenizers

from kvindex.api.config.settings import ApiSettings, ModelSpec
from kvindex.api.tokenize import choice as choice_module
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


def _in_hub(hub: Path, repo: str, model_dir: Path) -> Path:
    """``model_dir``'s files as the hub cache's current snapshot of ``repo``."""
    root = hub / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (snapshot / name).write_bytes((model_dir / name).read_bytes())
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("abc")
    return snapshot / "tokenizer.json"


def test_a_model_with_no_tokenizer_set_is_tokenized_by_the_hub_caches_file(
    tmp_path: Path, model_dir: Path
) -> None:
    hub = tmp_path / "hub"
    path = _in_hub(hub, "org/m", model_dir)
    settings = ApiSettings(models=(ModelSpec("org/m"),), hf_hub_cache=str(hub))
    local = LocalTokenizers(settings)
    assert local.spec("org/m") == TokenizerSpec(str(path))
    assert local.spec("org/unconfigured") is None
    tok = local.tokenizer("org/m")
    assert isinstance(tok, CachingTokenizer) and isinstance(tok.inner, LocalTokenizer)
    assert asyncio.run(tok.encode_messages(CONVERSATION))  # its chat template came along
    named = ApiSettings(models=(ModelSpec("org/m", tokenizer="replica"),), hf_hub_cache=str(hub))
    assert LocalTokenizers(named).tokenizer("org/m") is None  # replicas named: not looked up
    off = ApiSettings(models=(ModelSpec("org/m"),), hf_hub_cache="")
    assert LocalTokenizers(off).tokenizer("org/m") is None


def test_a_hub_file_that_cannot_be_read_is_not_used_until_forgotten(
    tmp_path: Path, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hub = tmp_path / "hub"
    path = _in_hub(hub, "org/m", model_dir)
    good = path.read_bytes()
    path.write_text("{}")
    local = LocalTokenizers(ApiSettings(hf_hub_cache=str(hub), tokenizer_cache_entries=0))
    assert local.tokenizer("org/m") is None
    assert "the hub cache's" in caplog.text and "is not used" in caplog.text
    path.write_bytes(good)
    assert local.tokenizer("org/m") is None  # remembered until forgotten
    local.forget("org/m")
    assert isinstance(local.tokenizer("org/m"), LocalTokenizer)


def test_the_hub_lookups_kept_are_bounded(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(choice_module, "MAX_LOOKUPS_KEPT", 4)
    _in_hub(tmp_path, "org/m", model_dir)
    local = LocalTokenizers(ApiSettings(hf_hub_cache=str(tmp_path), tokenizer_cache_entries=0))
    for i in range(50):
        assert local.spec(f"made-up-{i}") is None
        assert len(local._found) <= 4
    assert isinstance(local.tokenizer("org/m"), LocalTokenizer)


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
