"""The one console every ``kvindex`` command prints on for people: on a terminal, tables wrap
at spaces to its width; elsewhere (or ``--wide``) no colour and no width limit, a row a line."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Literal, TextIO

from rich import box
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.measure import Measurement
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

PIPE_WIDTH = 10_000  # off a terminal: wider than any table
REDRAW_S = 0.1  # progress bars are redrawn at most this often (and when one completes)


def make_console(file: TextIO | None = None, *, wide: bool = False) -> Console:
    """A console on ``file`` (default: ``sys.stdout`` now), laid out for where it goes or wide."""
    out = sys.stdout if file is None else file
    if not Console(file=out).is_terminal:
        return Console(file=out, width=PIPE_WIDTH, no_color=True, highlight=False)
    return Console(file=out, width=PIPE_WIDTH if wide else None, highlight=False)


def progress_console() -> Console:
    """Progress bars go to stderr, so that stdout holds the results alone."""
    return make_console(sys.stderr)


def column(header: str, *, justify: Literal["left", "right"] = "left") -> Column:
    """A column for :func:`make_table`: it wraps at spaces and folds a word too long for it."""
    return Column(header, justify=justify, overflow="fold")


def make_table(*columns: Column, title: str | None = None, caption: str | None = None) -> Table:
    """A table that fits the width it is printed at (:func:`fit_columns`), drawn as ``ps`` and
    ``kubectl`` do: a rule under the header, no frame, no trailing spaces."""
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
    return console.measure(renderable, options=console.options.update_width(PIPE_WIDTH)).maximum


def fit_columns(console: Console, table: Table, width: int) -> None:
    """Cap ``table``'s columns to fit ``width``: the widest narrows first, none below its longest
    word until the words alone are too wide (a word longer than its column folds)."""
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
    options = console.options.update_width(PIPE_WIDTH)
    sizes = [Measurement.get(console, options, cell) for cell in (col.header, *col.cells)]
    return max(size.minimum for size in sizes), max(size.maximum for size in sizes)


def _narrow(widths: list[int], floors: list[int], target: int) -> list[int]:
    """``widths`` narrowed, widest (leftmost) first, none below its floor, to sum ``target``."""
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
    """A rich table fitted to each render's width, its lines without trailing spaces."""

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
    while line and not line[-1].control and not line[-1].text.rstrip():
        line = line[:-1]
    if line and not line[-1].control:
        text, style, _ = line[-1]
        line = [*line[:-1], Segment(text.rstrip(), style)]
    return line


class ProgressBars:
    """One bar per task on ``console`` (None: nothing drawn), a context manager around the
    work; redrawn by the thread that advances them, never by rich's (it could outlive us)."""

    def __init__(self, console: Console | None, label_width: int) -> None:
        from rich.progress import (  # noqa: PLC0415 (the views draw no bar)
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

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
        """A new bar of ``total`` steps; the function returned advances it."""
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
