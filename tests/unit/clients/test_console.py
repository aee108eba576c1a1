"""The one console of the CLI (clients/cli/console.py): where output goes decides its layout."""

from __future__ import annotations

import io
import re
import threading

import pytest
from rich.console import Console
from rich.table import Table

from kvindex.clients.console import (
    PIPE_WIDTH,
    ProgressBars,
    column,
    fit_columns,
    make_console,
    make_table,
)

ANSI = re.compile(r"\x1b\[[0-9;]*m")
PROSE = "run 3 wait 1 kv 50% (1.2s old, scrape) +2 routed"
LONG_ID = "replica-with-an-identifier-far-longer-than-any-terminal-is-wide-" + "x" * 120


def terminal(monkeypatch: pytest.MonkeyPatch, columns: int) -> None:
    """Make the next consoles see a terminal ``columns`` wide (rich's own switches)."""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setenv("NO_COLOR", "1")


def printed(console: Console, *renderables: object) -> str:
    """What ``console`` (on a StringIO) shows of ``renderables``, styles stripped."""
    assert isinstance(console.file, io.StringIO)
    console.print(*renderables)
    return ANSI.sub("", console.file.getvalue())


def figures() -> Table:
    """A table like ``kvindex simulate``'s: a label, then ten columns of figures."""
    names = ("hit rate", "prefill tok", "TTFT mean", "p50", "p90", "p99", "queue", "max")
    table = make_table(
        column("policy"),
        *(column(name, justify="right") for name in (*names, "balance", "rejected")),
    )
    values = ("63.0%", "1,234,567", "0.123", "0.100", "0.456", "1.234", "0.52", "7", "1.04")
    for label in ("round_robin", "session_affinity", "kv_aware"):
        table.add_row(label, *values, "0")
    return table


# --- where the output goes --------------------------------------------------------------------


def test_off_a_terminal_the_console_is_plain_and_wider_than_any_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # an exported COLUMNS must not narrow a pipe
    monkeypatch.delenv("NO_COLOR", raising=False)
    console = make_console(io.StringIO())
    assert (console.is_terminal, console.no_color, console.width) == (False, True, PIPE_WIDTH)
    assert make_console().file is not None  # the default: the current sys.stdout


def test_on_a_terminal_the_console_takes_its_width(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal(monkeypatch, 100)
    console = make_console(io.StringIO())
    assert (console.is_terminal, console.width) == (True, 100)
    assert make_console(io.StringIO(), wide=True).width == PIPE_WIDTH


def test_piped_rows_are_one_line_with_whole_values() -> None:
    table = make_table(column("id"), column("load"), column("note"))
    table.add_row(LONG_ID, PROSE, "x " * 150)
    table.add_row("r2", "-", "short")
    text = printed(make_console(io.StringIO()), table)
    assert "…" not in text
    rows = [line for line in text.splitlines() if line.startswith(("replica-", "r2 "))]
    assert len(rows) == 2
    assert LONG_ID in rows[0] and PROSE in rows[0] and ("x " * 150).strip() in rows[0]
    assert not any(line.endswith(" ") for line in text.splitlines())  # cells are not padded out


# --- fitting a terminal -----------------------------------------------------------------------


def test_eleven_columns_of_figures_fit_100_columns_with_every_value_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    terminal(monkeypatch, 100)
    text = printed(make_console(io.StringIO()), figures())
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100
    for label in ("round_robin", "session_affinity", "kv_aware"):
        row = next(line for line in lines if line.startswith(label))
        assert "63.0%" in row and "1,234,567" in row and row.rstrip().endswith(" 0")


def test_fit_wraps_prose_at_spaces_before_breaking_a_word() -> None:
    table = make_table(column("id"), column("load"), column("score", justify="right"))
    table.add_row("replica-0001", PROSE, "0.6543")
    text = printed(Console(file=io.StringIO(), width=40), table)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 40
    first, *rest = lines[2:]  # below the header and its rule
    assert (first.split()[0], first.split()[-1]) == ("replica-0001", "0.6543")  # both whole
    words = first.split()[1:-1] + [word for line in rest for word in line.split()]
    assert " ".join(words) == PROSE  # wrapped at spaces only, in order


def test_too_narrow_for_the_words_folds_the_widest_without_an_ellipsis() -> None:
    table = make_table(column("id"), column("n", justify="right"))
    table.add_row(LONG_ID, "12345")
    text = printed(Console(file=io.StringIO(), width=30), table)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 30
    body = text.splitlines()[2:]
    assert "12345" in body[0]
    assert "".join(line.split()[0] for line in body) == LONG_ID


def test_a_table_that_fits_keeps_its_natural_widths() -> None:
    table = make_table(column("id"), column("load"))
    table.add_row("r1", PROSE)
    fit_columns(Console(file=io.StringIO(), width=200), table, 200)
    assert [c.max_width for c in table.columns] == [None, None]
    fit_columns(Console(file=io.StringIO(), width=30), table, 30)
    assert table.columns[0].max_width is None and table.columns[1].max_width is not None
    fit_columns(Console(file=io.StringIO(), width=200), table, 200)  # refitted at each render
    assert [c.max_width for c in table.columns] == [None, None]


# --- progress bars ----------------------------------------------------------------------------


def test_progress_bars_off_a_terminal_are_drawn_once_and_leave_no_thread() -> None:
    before = set(threading.enumerate())
    console = make_console(io.StringIO())
    with ProgressBars(console, label_width=12) as bars:
        advance = bars.add("kv_aware", total=3)
        for _ in range(3):
            advance(1)
    text = printed(console)
    assert text.count("kv_aware") == 1 and "3/3" in text
    assert set(threading.enumerate()) <= before


def test_progress_bars_without_a_console_draw_nothing() -> None:
    with ProgressBars(None, label_width=4) as bars:
        bars.add("quiet", total=1)(1)
