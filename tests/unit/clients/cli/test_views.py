"""The views' command plumbing (clients/cli/views.py): the strip's width, prompt files."""

from __future__ import annotations

import io
from pathlib import Path

import click
import pytest
from rich.console import Console

from kvindex.clients.cli.render import render_residency
from kvindex.clients.cli.views import (
    STRIP_WIDTH,
    fit_strip,
    prompt_fields,
    read_messages,
    read_tokens,
)
from kvindex.clients.console import make_console
from tests.unit.clients.cli.test_render import answer, on_terminal


def test_fit_strip_fills_the_terminal_up_to_the_strip_width() -> None:
    long = answer(num_blocks=200)
    for columns in (60, 80, 100):
        console = Console(file=io.StringIO(), width=columns)
        cells = fit_strip(console, long)
        assert 8 <= cells < STRIP_WIDTH
        lines = on_terminal(columns, *render_residency(long, cells))
        table = lines[1:-2]  # between the heading and the legend
        assert max(len(line) for line in table) <= columns
        assert max(len(line) for line in table) > columns - 3  # and nearly fills it
    assert fit_strip(make_console(io.StringIO()), long) == STRIP_WIDTH  # piped


def test_read_tokens_both_forms(tmp_path: Path) -> None:
    as_json = tmp_path / "a.json"
    as_json.write_text("[1, 2, 3]")
    spaced = tmp_path / "a.txt"
    spaced.write_text("1 2\n3\n")
    assert read_tokens(as_json) == read_tokens(spaced) == [1, 2, 3]
    for bad_text in ("[1.5]", "[true]", "1 x", '{"a": 1}'):
        bad = tmp_path / "bad"
        bad.write_text(bad_text)
        with pytest.raises(click.BadParameter):
            read_tokens(bad)


def test_read_messages(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text('[{"role": "user", "content": "hi"}]')
    assert read_messages(path) == [{"role": "user", "content": "hi"}]
    path.write_text('{"role": "user"}')
    with pytest.raises(click.BadParameter, match="list"):
        read_messages(path)


def test_prompt_fields_needs_exactly_one(tmp_path: Path) -> None:
    assert prompt_fields("hi", None, None) == {"prompt": "hi"}
    with pytest.raises(click.UsageError, match="exactly one"):
        prompt_fields(None, None, None)
    with pytest.raises(click.UsageError, match="exactly one"):
        prompt_fields("hi", tmp_path, None)
