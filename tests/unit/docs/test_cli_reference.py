"""The CLI reference: every command and option has help, and the page lists them all."""

from __future__ import annotations

import types
from collections.abc import Iterator

import click

from kvindex.clients.cli.main import main
from tests.unit.docs.conftest import ROOT
from tests.unit.docs.test_configuration_reference import _sections

KNOWN_WITHOUT_HELP: set[str] = set()
"""Options still without help (the CLI's owners write it, then drop the entry from here)."""


def _walk(command: click.Command, name: str) -> Iterator[tuple[str, click.Command]]:
    """Every command under ``command``, found through click alone (not the generator)."""
    yield name, command
    if isinstance(command, click.Group):
        for sub_name, sub in sorted(command.commands.items()):
            if not sub.hidden:
                yield from _walk(sub, f"{name} {sub_name}")


def _options(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option) and not p.hidden]


def _without_help() -> set[str]:
    missing = set()
    for name, command in _walk(main, "kvindex"):
        if not (command.help or "").strip():
            missing.add(name)
        missing |= {f"{name} {o.opts[-1]}" for o in _options(command) if not o.help}
    return missing


def test_every_command_and_option_has_help() -> None:
    assert _without_help() - KNOWN_WITHOUT_HELP == set()


def test_known_options_without_help_still_lack_it() -> None:
    assert KNOWN_WITHOUT_HELP - _without_help() == set(), "they have help now: drop them"


def test_the_page_lists_every_command_and_option(reference: types.ModuleType) -> None:
    sections = _sections(reference.cli_markdown())
    for name, command in _walk(main, "kvindex"):
        text = sections[f"`{name}`"]
        first_line = (command.help or "").strip().splitlines()[0]
        assert reference.prose(first_line) in text
        for option in _options(command):
            for spelling in (*option.opts, *option.secondary_opts):
                assert f"`{spelling}`" in text, f"{name} {spelling} not listed"
    assert len(sections) == len(list(_walk(main, "kvindex")))


def test_the_cli_page_asks_for_the_generated_reference(reference: types.ModuleType) -> None:
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert reference.CLI_MARKER in page
    assert "## `kvindex serve`" in reference.on_page_markdown(page)
