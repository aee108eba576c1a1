"""The package's shape: imports run down the floors (indexer, then api, then clients) and
never in a circle."""

from __future__ import annotations

from tests.support.house import PACKAGES, cycles, module_imports


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
