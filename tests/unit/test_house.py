"""The package's shape: imports run down the floors (indexer, then api, then clients) and
never in a circle, between modules or between rooms; prose within its budget (docstring lines
per 100 lines of code); no source file past the length bound but the compiled core."""

from __future__ import annotations

import importlib
import re

from tests.support.house import (
    CYTHON_CORE,
    MAX_LINES,
    PACKAGES,
    ROOT,
    cycles,
    docstring_lines_per_100,
    module_imports,
    prose,
    room_imports,
    source_files,
)


def _floor(module: str) -> int:
    return PACKAGES.index(module.split(".")[1])


def test_no_module_imports_from_a_higher_floor() -> None:
    graph = module_imports()
    upward = [
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if _floor(target) > _floor(module)
    ]
    assert upward == []


def test_no_module_import_cycle() -> None:
    assert cycles(module_imports()) == []


def test_rooms_import_each_other_in_one_direction_only() -> None:
    """A folder is a room: no room imports, directly or not, a room that imports it."""
    assert cycles(room_imports(module_imports())) == []


def test_prose_stays_within_its_budget() -> None:
    files = [prose(path) for path in source_files()]
    assert docstring_lines_per_100(files) <= 10


def test_no_source_file_outgrows_the_length_bound() -> None:
    long = [
        f"{path} ({prose(path).lines} lines)"
        for path in source_files()
        if path != CYTHON_CORE and prose(path).lines > MAX_LINES
    ]
    assert long == []


_REFERENCE = re.compile(r"Reference: ([\w.]+); (tests/[\w/]+\.py)::(\w+)")


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ImportError(dotted)


def test_every_fast_copy_names_a_reference_and_a_test_that_exist() -> None:
    """A ``Reference:`` line names an importable reference and an existing test function."""
    declared = [
        match.groups()
        for path in source_files()
        for match in _REFERENCE.finditer((ROOT / path).read_text())
    ]
    assert len(declared) >= 20
    for reference, test_file, test_name in declared:
        _resolve(reference)
        assert f"def {test_name}(" in (ROOT / test_file).read_text(), (test_file, test_name)
