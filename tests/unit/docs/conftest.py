"""The docs' reference generator, loaded by path (``docs/`` is not a package)."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
"""The repository's root."""


def load_reference() -> types.ModuleType:
    """``docs/hooks/reference.py`` as a module (registered, so its dataclasses resolve)."""
    path = ROOT / "docs" / "hooks" / "reference.py"
    spec = importlib.util.spec_from_file_location("kvindex_docs_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def reference() -> types.ModuleType:
    return load_reference()
