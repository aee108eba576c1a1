"""The docs' generated references: configuration from the settings classes, CLI from click.

A mkdocs hook (``hooks:`` in ``mkdocs.yml``): a page holding ``<!-- kvindex:configuration -->``
or ``<!-- kvindex:cli -->`` gets that marker replaced by tables generated from the code at
build time, so the references never drift from it. The tests under ``tests/unit/docs/``
load this file by path and hold it to the classes and the commands.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import re
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import click

CONFIGURATION_MARKER = "<!-- kvindex:configuration -->"
CLI_MARKER = "<!-- kvindex:cli -->"
PACKAGES = ("kvindex.indexer", "kvindex.api", "kvindex.clients")
CLI_ENTRY = "kvindex.clients.cli.main:main"


class ReferenceError(Exception):
    """The code holds something the references cannot place (e.g. a new settings class)."""


@dataclass(frozen=True)
class Table:
    """Where one settings class lives in the TOML file and the environment."""

    path: str
    """Dotted path of the class."""
    toml: str
    """Its TOML table: "" (top level), ``api``, ``[[models]]`` (an array of tables)."""
    env: str | None
    """Environment variable of a field, ``{FIELD}`` standing for its upper-case name; None:
    the fields are not read from the environment one by one."""
    env_notes: Mapping[str, str] = field(default_factory=dict)
    """Fields read from the environment another way (the note replaces the variable)."""
    note: str = ""
    """A sentence under the table's heading."""

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]

    def key(self, name: str) -> str:
        """A field's key as written in the file."""
        if not self.toml or self.toml.startswith("[["):
            return name
        return f"{self.toml}.{name}"

    def heading(self) -> str:
        if not self.toml:
            return "Indexer: top-level keys"
        table = self.toml if self.toml.startswith("[[") else f"[{self.toml}]"
        return f"`{table}`"

    def variable(self, name: str) -> str | None:
        if name in self.env_notes:
            return self.env_notes[name]
        return None if self.env is None else self.env.replace("{FIELD}", name.upper())


TABLES: tuple[Table, ...] = (
    Table(
        "kvindex.indexer.config.settings.IndexerSettings",
        "",
        "KVINDEX_{FIELD}",
        env_notes={"replicas": "— (`--replica`)", "discovery": "— (`[discovery]`)"},
        note="Read by `kvindex indexer`, `serve`, `api` and `proxy` from the file's top level.",
    ),
    Table(
        "kvindex.indexer.fleet.replica.ReplicaSpec",
        "[[replicas]]",
        None,
        note="One table per replica; `--replica id=r1,model=M,events=...` takes the same keys.",
    ),
    Table(
        "kvindex.api.config.settings.ApiSettings",
        "api",
        "KVINDEX_API_{FIELD}",
        env_notes={
            "weights": "`KVINDEX_API_WEIGHTS_<NAME>`",
            "models": "`KVINDEX_API_MODELS` (a JSON array of tables)",
            "rules": "`KVINDEX_API_RULES` (a JSON array of tables)",
        },
        note="Read by every process that answers: `serve`, `api`, `proxy`.",
    ),
    Table("kvindex.api.decision.policies.Weights", "api.weights", "KVINDEX_API_WEIGHTS_{FIELD}"),
    Table("kvindex.api.config.settings.ModelSpec", "[[models]]", None),
    Table(
        "kvindex.api.decision.routing_rules.RoutingRule",
        "[[rules]]",
        None,
        note="Tried in order; the first rule whose every condition holds wins.",
    ),
    Table("kvindex.clients.proxy.settings.ProxySettings", "proxy", "KVINDEX_PROXY_{FIELD}"),
    Table("kvindex.clients.picker.settings.PickerSettings", "picker", "KVINDEX_PICKER_{FIELD}"),
    Table(
        "kvindex.indexer.fleet.settings.DiscoverySettings",
        "discovery",
        "KVINDEX_DISCOVERY_{FIELD}",
        note="Read by `kvindex indexer`, `serve`, `proxy` and `picker` (`--k8s-*` options);"
        " see the Kubernetes page.",
    ),
)
"""Every settings class the configuration reference shows, in page order."""


def load(path: str) -> Any:
    """The object at ``package.module.Name`` or ``package.module:name``."""
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def settings_modules() -> Iterator[types.ModuleType]:
    """Every module named ``settings`` under the package's three folders."""
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        for info in pkgutil.walk_packages(package.__path__, f"{package_name}."):
            if info.name.rpartition(".")[2] == "settings":
                yield importlib.import_module(info.name)


def discovered_classes() -> list[str]:
    """Frozen dataclasses named ``*Settings`` or ``*Spec`` defined in a ``settings`` module."""
    found = []
    for module in settings_modules():
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and obj.__module__ == module.__name__
                and name.endswith(("Settings", "Spec"))
                and dataclasses.is_dataclass(obj)
                and obj.__dataclass_params__.frozen  # type: ignore[attr-defined]
            ):
                found.append(f"{module.__name__}.{name}")
    return sorted(found)


COMPOSITES = frozenset({"kvindex.api.config.settings.ReadPathSettings"})
"""Settings classes made only of the tables above (no keys of their own)."""


def checked_tables() -> tuple[Table, ...]:
    """:data:`TABLES`, once every discovered settings class is known to be among them."""
    placed = {table.path for table in TABLES} | COMPOSITES
    missing = [path for path in discovered_classes() if path not in placed]
    if missing:
        raise ReferenceError(
            f"settings classes with no place in the configuration reference: {missing};"
            " add each to TABLES in docs/hooks/reference.py (its TOML table and env rule)"
        )
    return TABLES


def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string statement under it), read with ast; the
    fields a dataclass inherits carry their base class's docs."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if base is not cls and dataclasses.is_dataclass(base):
            docs.update(field_docs(base))
    return docs | _own_field_docs(cls)


def _own_field_docs(cls: type) -> dict[str, str]:
    source = inspect.getsource(inspect.getmodule(cls))  # type: ignore[arg-type]
    node = next(
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.ClassDef) and n.name == cls.__name__
    )
    docs: dict[str, str] = {}
    for before, after in zip(node.body, node.body[1:], strict=False):
        if (
            isinstance(before, ast.AnnAssign)
            and isinstance(before.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[before.target.id] = " ".join(after.value.value.split())
    return docs


@dataclass(frozen=True)
class Setting:
    """One row of the configuration reference."""

    key: str
    type: str
    default: str
    variable: str | None
    doc: str


def settings_of(table: Table) -> list[Setting]:
    """The rows of one settings class, in field order."""
    cls = load(table.path)
    hints = get_type_hints(cls)
    docs = field_docs(cls)
    kinds = {name: type_text(hint) for name, hint in hints.items()}
    return [
        Setting(
            key=table.key(f.name),
            type=kinds[f.name],
            default=default_text(f, kinds[f.name]),
            variable=table.variable(f.name),
            doc=docs.get(f.name, ""),
        )
        for f in dataclasses.fields(cls)
    ]


_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean"}


def type_text(hint: Any) -> str:
    """A type as a TOML reader says it: ``integer``, ``"memory" or "redis"``, ``list of ...``."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return " or ".join(f'`"{a}"`' for a in args)
    if origin in (Union, types.UnionType):
        inner = [type_text(a) for a in args if a is not type(None)]
        return " or ".join(inner) + (" (optional)" if type(None) in args else "")
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = args[0]
        if get_origin(item) is tuple and get_args(item)[0] is str:  # pairs: a TOML table
            return f"table of {_plural(type_text(get_args(item)[1]))}"
        if dataclasses.is_dataclass(item):
            return "array of tables"
        return f"list of {_plural(type_text(item))}"
    if origin is dict:
        return f"table of {_plural(type_text(args[1]))}"
    if dataclasses.is_dataclass(hint):
        return "table"
    return _SCALARS.get(hint, getattr(hint, "__name__", str(hint)))


def _plural(text: str) -> str:
    if text in _SCALARS.values():
        return f"{text}s"
    return f"lists of {text.removeprefix('list of ')}" if text.startswith("list of ") else text


def default_text(f: dataclasses.Field[Any], kind: str = "") -> str:
    """A field's default as written in TOML (``kind``: its :func:`type_text`); ``required``
    when it has none."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "its table"
    if kind.startswith("table") and value == ():  # a table kept as pairs
        return "`{}`"
    return toml_text(value)


def toml_text(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, tuple | list):
        return "`[]`" if not value else f"`{list(value)!r}`"
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value!r}`"
    return f"`{value!r}`"


_ROLE = re.compile(r":(?:class|data|attr|func|meth|mod|exc):`~?([\w.]+)`")


def prose(text: str) -> str:
    """reStructuredText markup as Markdown (``<`` outside code spans escaped)."""
    text = _ROLE.sub(lambda m: f"`{m.group(1).rpartition('.')[2]}`", text)
    parts = text.replace("``", "`").split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def cell(text: str) -> str:
    """:func:`prose` on one line, safe in a table cell."""
    return prose(" ".join(text.split())).replace("|", "\\|")


def configuration_markdown() -> str:
    """Every settings table, one Markdown table each."""
    out = []
    for table in checked_tables():
        out += [f"## {table.heading()}", ""]
        if table.note:
            out += [table.note, ""]
        out += [f"Class: `{table.path}`.", ""]
        out += [
            "| key | type | default | environment | meaning |",
            "| --- | --- | --- | --- | --- |",
        ]
        for s in settings_of(table):
            variable = s.variable if s.variable is None or " " in s.variable else f"`{s.variable}`"
            out.append(
                f"| `{s.key}` | {s.type} | {s.default} | {variable or '—'} |"
                f" {cell(s.doc) or '**undocumented**'} |"
            )
        out.append("")
    return "\n".join(out)


@dataclass(frozen=True)
class Command:
    """One command of the CLI, with the context click renders its usage in."""

    path: tuple[str, ...]
    command: click.Command
    context: click.Context

    @property
    def name(self) -> str:
        return " ".join(self.path)


def commands(root: click.Command | None = None, prog: str = "kvindex") -> list[Command]:
    """The root command, then every subcommand (recursively, by name)."""
    root = root or load(CLI_ENTRY)
    found = []

    def walk(command: click.Command, path: tuple[str, ...], parent: click.Context | None) -> None:
        context = click.Context(command, info_name=path[-1], parent=parent)
        found.append(Command(path, command, context))
        if isinstance(command, click.Group):
            for name in command.list_commands(context):
                sub = command.get_command(context, name)
                if sub is not None and not sub.hidden:
                    walk(sub, (*path, name), context)

    walk(root, (prog,), None)
    return found


def options(command: Command) -> list[click.Option]:
    """A command's options, click's own ``--help`` left out."""
    own_help = command.command.get_help_option(command.context)
    return [
        p
        for p in command.command.get_params(command.context)
        if isinstance(p, click.Option) and p is not own_help and not p.hidden
    ]


def help_text(command: click.Command) -> str:
    """A command's help as Markdown paragraphs (click's ``\\b`` markers dropped)."""
    text = inspect.cleandoc(command.help or "")
    return prose(text.replace("\b\n", ""))


def option_row(option: click.Option) -> str:
    names = ", ".join(f"`{n}`" for n in (*option.opts, *option.secondary_opts))
    if option.is_flag:
        kind = "flag"
    elif isinstance(option.type, click.Choice):
        kind = " or ".join(f"`{c}`" for c in option.type.choices)
    else:
        kind = option.type.name
    if option.multiple:
        kind += ", repeatable"
    default = option.to_info_dict().get("default")
    shown = (
        "—"
        if default in (None, (), []) or (option.is_flag and default is False)
        else f"`{default}`"
    )
    envvar = option.envvar
    env = ", ".join(f"`{e}`" for e in ([envvar] if isinstance(envvar, str) else envvar or []))
    text = cell(option.help or "") or "**no help**"
    return f"| {names} | {kind} | {shown} | {env or '—'} | {text} |"


def cli_markdown() -> str:
    """Every command: its help, its usage and a table of its options."""
    out = []
    every = commands()
    for command in every:
        usage = command.command.get_usage(command.context).removeprefix("Usage: ")
        out += [f"## `{command.name}`", "", help_text(command.command), ""]
        out += ["```text", usage, "```", ""]
        rows = [option_row(o) for o in options(command)]
        if rows:
            out += ["| option | type | default | environment | help |"]
            out += ["| --- | --- | --- | --- | --- |", *rows, ""]
        if isinstance(command.command, click.Group):
            names = [c.name for c in every if c.path[:-1] == command.path]
            out += ["Commands: " + ", ".join(f"`{n}`" for n in names) + ".", ""]
    return "\n".join(out)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """mkdocs hook: fill the generated references into the pages that ask for them."""
    if CONFIGURATION_MARKER in markdown:
        markdown = markdown.replace(CONFIGURATION_MARKER, configuration_markdown())
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_markdown())
    return markdown
