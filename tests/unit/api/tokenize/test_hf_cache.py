"""kvindex.api.tokenize.hf_cache: where the hub cache is, and a model's ``tokenizer.json`` in
the snapshot its ``refs/main`` names (or its only one); nothing outside a repo id looked up."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvindex.api.tokenize.hf_cache import cached_tokenizer, hub_dir


@pytest.mark.parametrize(
    ("configured", "environ", "expected"),
    [
        ("/hub", {"HF_HUB_CACHE": "/other"}, "/hub"),
        ("", {"HF_HUB_CACHE": "/other"}, None),
        (None, {"HF_HUB_CACHE": "/cache", "HF_HOME": "/home"}, "/cache"),
        (None, {"HF_HOME": "/home", "XDG_CACHE_HOME": "/xdg"}, "/home/hub"),
        (None, {"XDG_CACHE_HOME": "/xdg"}, "/xdg/huggingface/hub"),
        (None, {}, str(Path("~/.cache/huggingface/hub").expanduser())),
    ],
)
def test_the_hub_is_found_as_huggingface_hub_finds_it(
    configured: str | None, environ: dict[str, str], expected: str | None
) -> None:
    found = hub_dir(configured, environ)
    assert (None if found is None else str(found)) == expected


def _snapshot(hub: Path, repo: str, revision: str, *, ref: bool = True) -> Path:
    root = hub / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").write_text("{}")
    if ref:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / "main").write_text(revision + "\n")
    return snapshot / "tokenizer.json"


def test_the_snapshot_refs_main_names_is_the_one_read(tmp_path: Path) -> None:
    _snapshot(tmp_path, "org/model", "old", ref=False)
    current = _snapshot(tmp_path, "org/model", "new")
    assert cached_tokenizer("org/model", tmp_path) == current
    assert cached_tokenizer("gpt2", tmp_path) is None
    assert cached_tokenizer("org/other", tmp_path) is None


def test_without_refs_only_a_single_snapshot_is_read(tmp_path: Path) -> None:
    only = _snapshot(tmp_path, "gpt2", "abc", ref=False)
    assert cached_tokenizer("gpt2", tmp_path) == only
    _snapshot(tmp_path, "gpt2", "def", ref=False)
    assert cached_tokenizer("gpt2", tmp_path) is None  # which one is current is unknown


def test_a_snapshot_without_a_tokenizer_json_has_none(tmp_path: Path) -> None:
    _snapshot(tmp_path, "org/model", "abc").unlink()
    assert cached_tokenizer("org/model", tmp_path) is None


@pytest.mark.parametrize(
    "model", ["", "../x", "org/../x", "a/b/c", "/abs", "org/", ".hidden", "org/model\n"]
)
def test_a_name_that_is_not_a_repo_id_is_not_looked_up(tmp_path: Path, model: str) -> None:
    assert cached_tokenizer(model, tmp_path) is None


def test_a_ref_naming_a_path_is_not_followed(tmp_path: Path) -> None:
    _snapshot(tmp_path, "org/model", "abc")
    (tmp_path / "models--org--model" / "refs" / "main").write_text("../../elsewhere")
    assert cached_tokenizer("org/model", tmp_path) is None
