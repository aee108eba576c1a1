"""A model's ``tokenizer.json`` in the local Hugging Face hub cache, where vLLM's own
downloads land: read only, nothing is fetched."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

# A hub repo id (``org/name`` or ``name``): no path of another form is looked up.
_REPO_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*")


def hub_dir(configured: str | None, environ: Mapping[str, str] = os.environ) -> Path | None:
    """``configured`` ("": none), else as ``huggingface_hub`` finds it: ``HF_HUB_CACHE``,
    else ``HF_HOME``/hub, else ``$XDG_CACHE_HOME`` (``~/.cache``)/huggingface/hub."""
    if configured is not None:
        return Path(configured).expanduser() if configured else None
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"]).expanduser()
    home = environ.get("HF_HOME") or os.path.join(
        environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(home).expanduser() / "hub"


def cached_tokenizer(model: str, hub: Path) -> Path | None:
    """The ``tokenizer.json`` of ``model`` (a repo id) in the snapshot ``refs/main`` names,
    else in its only snapshot; None when there is none."""
    if not _REPO_ID.fullmatch(model) or ".." in model:
        return None
    repo = hub / ("models--" + model.replace("/", "--"))
    snapshot = _snapshot(repo)
    if snapshot is None:
        return None
    path = snapshot / "tokenizer.json"
    return path if path.is_file() else None


def _snapshot(repo: Path) -> Path | None:
    try:
        revision = (repo / "refs" / "main").read_text().strip()
    except OSError:
        revision = ""
    if revision:
        named = repo / "snapshots" / revision
        return named if "/" not in revision and named.is_dir() else None
    try:
        snapshots = [p for p in (repo / "snapshots").iterdir() if p.is_dir()]
    except OSError:
        return None
    return snapshots[0] if len(snapshots) == 1 else None
