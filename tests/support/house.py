"""The package's shape as data: its modules' imports and its prose, read from source text.

``python -m tests.support.house`` prints the docstring budget of ``indexer/``, ``api/`` and
``clients/`` (worst files first) and the files over the length bound.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("indexer", "api", "clients")
"""The three rooms, bottom floor first: a module may import only from its own floor or below."""
MAX_LINES = 700
CYTHON_CORE = Path("indexer/native/_core.pyx")
_TRIPLE = re.compile(r'^[rbuRBU]?"""')


@dataclass(frozen=True)
class Prose:
    """Docstring and code lines of one file (code: not blank, not a comment, not a docstring)."""

    path: Path
    docstring_lines: int
    code_lines: int
    lines: int


def source_files(packages: tuple[str, ...] = PACKAGES) -> list[Path]:
    """Every ``.py`` and ``.pyx`` file of ``packages``, relative to the checkout, vendored code
    left out."""
    found = []
    for package in packages:
        for path in sorted((ROOT / package).rglob("*")):
            if path.suffix in (".py", ".pyx") and "vendor" not in path.parts:
                found.append(path.relative_to(ROOT))
    return found


def _python_docstring_lines(source: str) -> set[int]:
    """Lines of every string statement (module, class, function and attribute docstrings)."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        for statement in body if isinstance(body, list) else []:
            if (
                isinstance(statement, ast.Expr)
                and isinstance(statement.value, ast.Constant)
                and isinstance(statement.value.value, str)
            ):
                end = statement.end_lineno or statement.lineno
                lines.update(range(statement.lineno, end + 1))
    return lines


def _cython_docstring_lines(source: str) -> set[int]:
    """Lines of every triple-quoted string that starts a line (Cython has no ``ast``)."""
    lines: set[int] = set()
    inside = False
    for number, line in enumerate(source.splitlines(), 1):
        text = line.strip()
        if inside or _TRIPLE.match(text):
            lines.add(number)
            quotes = text.count('"""')
            inside = (quotes % 2 == 1) != inside
    return lines


def prose(path: Path) -> Prose:
    source = (ROOT / path).read_text()
    reader = _cython_docstring_lines if path.suffix == ".pyx" else _python_docstring_lines
    docs = reader(source)
    code = 0
    all_lines = source.splitlines()
    for number, line in enumerate(all_lines, 1):
        text = line.strip()
        if text and number not in docs and not text.startswith("#"):
            code += 1
    return Prose(path, len(docs), code, len(all_lines))


def docstring_lines_per_100(files: list[Prose]) -> float:
    return 100 * sum(f.docstring_lines for f in files) / max(1, sum(f.code_lines for f in files))


def imports_of(path: Path) -> set[str]:
    """The ``kvindex.*`` modules ``path`` imports (anywhere in it, TYPE_CHECKING blocks too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from a.b import c`` names the module a.b.c if there is one, else a.b.
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("kvindex.")}


def module_name(path: Path) -> str:
    parts = list(path.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["kvindex", *parts])


def module_imports(files: list[Path] | None = None) -> dict[str, set[str]]:
    """Each module of the tree → the modules of the tree it imports (a name imported from a
    module counts as that module; a package's name as its ``__init__``)."""
    paths = {module_name(p): p for p in (files or source_files()) if p.suffix == ".py"}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        graph[name] = {_in_tree(imported, paths) for imported in imports_of(path)} - {"", name}
    return graph


def _in_tree(imported: str, paths: dict[str, Path]) -> str:
    """The module of the tree that ``imported`` names ("" for none)."""
    while imported and imported not in paths:
        imported = imported.rpartition(".")[0]
    return imported


def room_of(module: str, graph: dict[str, set[str]]) -> str:
    """A module's room: the package it sits in (a package's ``__init__`` is in its own)."""
    return module if module in _packages() else module.rpartition(".")[0]


def _packages() -> set[str]:
    return {module_name(p) for p in source_files() if p.name == "__init__.py"}


def room_imports(graph: dict[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """Room → room it imports from → the ``module -> module`` arrows that make the edge."""
    rooms: dict[str, dict[str, list[str]]] = {}
    for module, targets in graph.items():
        for target in targets:
            here, there = room_of(module, graph), room_of(target, graph)
            if here != there:
                rooms.setdefault(here, {}).setdefault(there, []).append(f"{module} -> {target}")
    return rooms


def cycles(graph: dict[str, set[str]] | dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = _pop_component(stack, node)
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def _pop_component(stack: list[str], root: str) -> list[str]:
    component = []
    while True:
        member = stack.pop()
        component.append(member)
        if member == root:
            return component


def _main() -> None:
    paths = [Path(arg) for arg in sys.argv[1:]] or [Path(p) for p in PACKAGES]
    files = [prose(f) for f in source_files(tuple(str(p) for p in paths))]
    print(f"docstring lines per 100 lines of code: {docstring_lines_per_100(files):.1f}")
    for f in sorted(files, key=lambda f: f.docstring_lines - 0.1 * f.code_lines, reverse=True)[:25]:
        ratio = 100 * f.docstring_lines / max(1, f.code_lines)
        print(f"  {ratio:5.1f}  {f.docstring_lines:4d} / {f.code_lines:4d}  {f.path}")
    for f in files:
        if f.lines > MAX_LINES and f.path != CYTHON_CORE:
            print(f"over {MAX_LINES} lines: {f.path} ({f.lines})")
    graph = module_imports()
    rooms = room_imports(graph)
    print("module cycles:", cycles(graph))
    for component in cycles(rooms):
        print("room cycle:", component)
        for here in component:
            for there, arrows in rooms.get(here, {}).items():
                if there in component:
                    print(f"    {here} -> {there}: {arrows[0]} (+{len(arrows) - 1})")


if __name__ == "__main__":
    _main()
