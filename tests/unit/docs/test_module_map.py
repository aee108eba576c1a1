"""The module map names every package folder and module of the tree, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit.docs.conftest import ROOT

MAP = ROOT / "docs" / "module-map.md"
ROOMS = ("indexer", "api", "clients")
_ENTRY = re.compile(r"^- `([^`]+)`", re.MULTILINE)


def map_entries(text: str) -> set[str]:
    """The paths the map names: the code span opening each top-level list item."""
    return set(_ENTRY.findall(text))


def tree_entries(root: Path) -> set[str]:
    """Package folders (with a trailing ``/``), modules (``__init__.py`` aside) and ``.pyx``."""
    found = set()
    for room in ROOMS:
        for path in sorted((root / room).rglob("*")):
            relative = path.relative_to(root).as_posix()
            if path.is_dir() and (path / "__init__.py").exists():
                found.add(relative + "/")
            elif path.suffix in {".py", ".pyx"} and path.name != "__init__.py":
                found.add(relative)
        found.add(f"{room}/")
    return found


def test_map_entries_reads_the_list_items_only() -> None:
    text = "intro `not/this.py`\n- `api/score.py` — the scorer, see `api/schemas.py`\n- plain\n"
    assert map_entries(text) == {"api/score.py"}


def test_every_folder_and_module_is_on_the_map() -> None:
    missing = tree_entries(ROOT) - map_entries(MAP.read_text())
    assert missing == set(), f"add to docs/module-map.md: {sorted(missing)}"


def test_everything_the_map_names_exists() -> None:
    named = map_entries(MAP.read_text())
    gone = sorted(p for p in named if not (ROOT / p).exists())
    assert gone == [], f"on docs/module-map.md but not in the tree: {gone}"
    wrong = sorted(p for p in named if p.endswith("/") != (ROOT / p).is_dir())
    assert wrong == [], f"folders end with '/', files do not: {wrong}"
