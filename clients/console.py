"""The one console every ``kvindex`` command prints its output for people on.

Where the output goes decides how it is laid out:

- **A terminal** (stdout is a TTY, or rich's ``TTY_COMPATIBLE=1`` / ``FORCE_COLOR`` say it
  is one): rich measures its width (``COLUMNS`` is honoured) and a table that does not fit
  wraps its cells at spaces. Colour unless ``NO_COLOR`` is set.
- **Anything else** (a pipe, a file, ``less``, a test's runner): no colour and a width no
  table reaches (:data:`PIPE_WIDTH`), so every row is one line with whole values, as wide
  as its content: ``grep``, ``cut`` and ``less -S`` see every value, never wrapped or cut
  short. Scripts want ``--json`` instead, where a command has it.
- **Wide** (a command's ``--wide``: every column): that width on a terminal too, as
  ``kubectl -o wide`` does: rows too long for the terminal are wrapped by the terminal
  (or not, in ``less -S``), never squeezed into columns a few characters wide.

Tables are built by :func:`make_table` from :func:`column`: fitted to the width they are
printed at by :func:`fit_columns` (the widest columns wrap first, at spaces; words stay
whole while they can), and a word longer than its column folds rather than ending in
``…`` (rich's default), so even a too-narrow terminal shows every character.
:class:`ProgressBars` draws the long commands' progress on the same console.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Literal, TextIO

from rich import box
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.segment import Segment
from rich.table import Column, Table

__all__ = [
    "PIPE_WIDTH",
    "REDRAW_S",
    "ProgressBars",
    "column",
    "fit_columns",
    "make_console",
    "make_table",
    "natural_width",
]

PIPE_WIDTH = 10_000
"""Console width off a terminal: wider than any table, so none is wrapped or shortened."""
REDRAW_S = 0.1
"""Progress bars are redrawn at most this often (and when a bar completes)."""


def make_console(file: TextIO | None = None, *, wide: bool = False) -> Console:
    """A console on ``file`` (default: the current ``sys.stdout``), laid out for where it
    goes, or ``wide`` (see the module's docstring). Call it when printing, not at import: a
    test runner swaps ``sys.stdout`` per invocation."""
    out = sys.stdout if file is None else file
    if not Console(file=out).is_terminal:
        return Console(file=out, width=PIPE_WIDTH, no_color=True, highlight=False)
    return Console(file=out, width=PIPE_WIDTH if wide else None, highlight=False)


def progress_console() -> Console:
    """The console progress bars go to: stderr, so that stdout, piped or redirected, holds
    the results alone (as ``curl`` and ``pip`` do)."""
    return make_console(sys.stderr)


def column(header: str, *, justify: Literal["left", "right"] = "left") -> Column:
    """A table column for :func:`make_table`: it may wrap at spaces, and a word longer than
    the column folds onto the next line instead of ending in ``…``."""
    return Column(header, justify=justify, overflow="fold")


def make_table(*columns: Column, title: str | None = None, caption: str | None = None) -> Table:
    """A table of ``columns`` (built by :func:`column`) that fits the width it is printed
    at, as :func:`fit_columns` lays it out. Drawn as ``ps`` and ``kubectl`` do: a rule
    under the header, columns two spaces apart, no frame (11 columns of figures fit 100
    columns). Title and caption on the left, not padded to the table's width (no trailing
    spaces in a file)."""
    return _FittedTable(
        *columns,
        title=title,
        caption=caption,
        title_justify="default",
        caption_justify="default",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )


def natural_width(console: Console, renderable: RenderableType) -> int:
    """Columns ``renderable`` takes when nothing limits its width."""
    return console.measure(renderable, options=console.options.update_width(PIPE_WIDTH)).maximum


def fit_columns(console: Console, table: Table, width: int) -> None:
    """Cap ``table``'s columns (``Column.max_width``) so that it fits ``width``.

    Rich alone narrows the widest columns with no regard for words: numbers and ids end up
    broken over lines while a column of prose keeps spaces to spare. Here the widest column
    narrows first, one character at a time, and none below its longest word (a number, an
    id, a header word); only when the words alone are wider than ``width`` do the widest
    columns go below them (and fold). A table that fits is left as it is."""
    for col in table.columns:
        col.max_width = None
    natural = natural_width(console, table)
    if natural <= width:
        return
    spans = [_span(console, col) for col in table.columns]
    longest = [most for _, most in spans]
    target = width - (natural - sum(longest))  # what borders and padding leave the cells
    widths = _narrow(
        _narrow(longest, [word for word, _ in spans], target), [1] * len(spans), target
    )
    for col, fitted, most in zip(table.columns, widths, longest, strict=True):
        col.max_width = fitted if fitted < most else None


def _span(console: Console, col: Column) -> tuple[int, int]:
    """(longest word, longest line) of a column's header and cells."""
    options = console.options.update_width(PIPE_WIDTH)
    sizes = [Measurement.get(console, options, cell) for cell in (col.header, *col.cells)]
    return max(size.minimum for size in sizes), max(size.maximum for size in sizes)


def _narrow(widths: list[int], floors: list[int], target: int) -> list[int]:
    """``widths`` narrowed by one, the widest (leftmost of equals) first, none below its
    floor, until their sum is ``target`` or none can narrow."""
    out = list(widths)
    excess = sum(out) - target
    while excess > 0:
        movable = [i for i, w in enumerate(out) if w > floors[i]]
        if not movable:
            break
        out[max(movable, key=out.__getitem__)] -= 1
        excess -= 1
    return out


class _FittedTable(Table):
    """A rich table laid out by :func:`fit_columns` for the width of each render, its
    lines without the spaces that pad the last cell to its column's width."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        fit_columns(console, self, options.max_width)
        rendered = super().__rich_console__(console, options)
        segments = (
            piece
            for item in rendered
            for piece in ([item] if isinstance(item, Segment) else console.render(item, options))
        )
        for line in Segment.split_lines(segments):
            yield from _unpadded(line)
            yield Segment.line()


def _unpadded(line: list[Segment]) -> list[Segment]:
    """``line`` without its trailing spaces."""
    while line and not line[-1].control and not line[-1].text.rstrip():
        line = line[:-1]
    if line and not line[-1].control:
        text, style, _ = line[-1]
        line = [*line[:-1], Segment(text.rstrip(), style)]
    return line


class ProgressBars:
    """One bar per task (label, done / total, elapsed), on ``console``; ``None``: nothing
    is drawn. Used as a context manager around the work.

    Bars are redrawn on the thread that advances them, at most every :data:`REDRAW_S` and
    when a bar completes, never by rich's refresh thread: that thread is told to stop but
    not joined, so it could outlive the command. Not thread-safe: one thread advances.
    Off a terminal rich draws the bars once, as they end."""

    def __init__(self, console: Console | None, label_width: int) -> None:
        self._progress = Progress(
            TextColumn(f"{{task.description:>{label_width}}}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            disable=console is None,
            auto_refresh=False,
        )
        self._drawn_at = 0.0

    def __enter__(self) -> ProgressBars:
        self._progress.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._progress.stop()

    def add(self, label: str, total: int) -> Callable[[int], None]:
        """A new bar of ``total`` steps; the function returned advances it by its argument."""
        task = self._progress.add_task(label, total=total)
        done = 0

        def advance(steps: int) -> None:
            nonlocal done
            done += steps
            self._progress.advance(task, steps)
            now = time.monotonic()
            if now - self._drawn_at >= REDRAW_S or done >= total:
                self._drawn_at = now
                self._progress.refresh()

        return advance
