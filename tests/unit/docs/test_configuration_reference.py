"""The configuration reference: every settings field documented, listed, and set as it says."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from kvindex.api.config.settings import load_api_settings
from kvindex.clients.picker.settings import load_picker_settings
from kvindex.clients.proxy.settings import load_proxy_settings
from kvindex.indexer.config.settings import load_settings
from tests.unit.docs.conftest import ROOT

KNOWN_UNDOCUMENTED: set[str] = set()
"""Fields still without a doc line (the package's owners add it, then drop it from here)."""

EXPECTED_CLASSES = {
    "kvindex.indexer.config.settings.IndexerSettings",
    "kvindex.api.config.settings.ApiSettings",
    "kvindex.api.config.settings.ModelSpec",
    "kvindex.clients.proxy.settings.ProxySettings",
}
"""Settings classes discovery must find whatever else it finds."""


@dataclass(frozen=True)
class _Sample:
    documented: int = 1
    """Its doc,
    on two lines."""
    bare: int = 2


def _undocumented(reference: types.ModuleType) -> set[str]:
    missing = set()
    for table in reference.checked_tables():
        cls = reference.load(table.path)
        docs = reference.field_docs(cls)
        missing |= {
            f"{table.path}.{f.name}" for f in dataclasses.fields(cls) if not docs.get(f.name)
        }
    return missing


def test_field_docs_reads_the_string_under_each_field(reference: types.ModuleType) -> None:
    assert reference.field_docs(_Sample) == {"documented": "Its doc, on two lines."}


def test_every_settings_field_has_a_doc_line(reference: types.ModuleType) -> None:
    assert _undocumented(reference) - KNOWN_UNDOCUMENTED == set()


def test_known_undocumented_fields_are_still_undocumented(reference: types.ModuleType) -> None:
    assert KNOWN_UNDOCUMENTED - _undocumented(reference) == set(), "documented now: drop them"


def test_discovery_finds_the_settings_classes_and_each_has_a_table(
    reference: types.ModuleType,
) -> None:
    assert set(reference.discovered_classes()) >= EXPECTED_CLASSES
    placed = {table.path for table in reference.checked_tables()}
    assert set(reference.discovered_classes()) <= placed | reference.COMPOSITES


def test_a_settings_class_without_a_table_fails_the_build(
    reference: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    tables = tuple(t for t in reference.TABLES if not t.path.endswith(".ProxySettings"))
    monkeypatch.setattr(reference, "TABLES", tables)
    with pytest.raises(reference.ReferenceError, match="ProxySettings"):
        reference.configuration_markdown()


def _sections(markdown: str) -> dict[str, str]:
    """``## heading`` → the text under it."""
    out: dict[str, str] = {}
    for chunk in ("\n" + markdown).split("\n## ")[1:]:
        heading, _, text = chunk.partition("\n")
        out[heading] = text
    return out


def test_the_page_lists_every_field_of_every_class(reference: types.ModuleType) -> None:
    sections = _sections(reference.configuration_markdown())
    for table in reference.TABLES:
        text = sections[table.heading()]
        assert f"`{table.path}`" in text
        for f in dataclasses.fields(reference.load(table.path)):
            assert f"| `{table.key(f.name)}` |" in text, f"{table.path}.{f.name} not listed"


def test_the_configuration_page_asks_for_the_generated_tables(
    reference: types.ModuleType,
) -> None:
    page = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    assert reference.CONFIGURATION_MARKER in page
    filled = reference.on_page_markdown(page)
    assert reference.CONFIGURATION_MARKER not in filled
    assert "| `api.port` |" in filled


def _changed(value: object) -> object | None:
    """A valid value other than a numeric or boolean default (None: not such a field)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    return None


def _env_text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


Loader = Callable[[Mapping[str, str]], Any]
LOADERS: dict[str, Loader] = {
    "IndexerSettings": lambda env: load_settings(env=env),
    "ApiSettings": lambda env: load_api_settings(env=env),
    "Weights": lambda env: load_api_settings(env=env).weights,
    "ProxySettings": lambda env: load_proxy_settings(env=env),
    "PickerSettings": lambda env: load_picker_settings(env=env),
    "DiscoverySettings": lambda env: load_settings(env=env).discovery,
}
"""How each class whose fields are read from the environment one by one is loaded."""


def test_every_documented_variable_sets_its_field(reference: types.ModuleType) -> None:
    checked = 0
    for table in reference.TABLES:
        if table.env is None:
            continue
        load = LOADERS[table.name]
        for f, setting in zip(
            dataclasses.fields(reference.load(table.path)),
            reference.settings_of(table),
            strict=True,
        ):
            wanted = _changed(f.default)
            if wanted is None or setting.variable is None or " " in setting.variable:
                continue
            got = getattr(load({setting.variable: _env_text(wanted)}), f.name)
            assert got == wanted, f"{setting.variable} did not set {table.name}.{f.name}"
            checked += 1
    assert checked > 50
