"""The readable output of ``kvindex analyze``: tables on the one console, and the plot."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvindex.clients.analyze.report import AnalysisReport
from kvindex.clients.console import column, make_table
from kvindex.clients.plotting import pyplot

TEXT_CHARS = 60
"""Decoded text is cut to this many characters in the tables (``--json`` has all of it)."""


def _short(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= TEXT_CHARS else flat[:TEXT_CHARS] + "…"


def print_report(report: AnalysisReport, console: Console) -> None:
    """Totals, findings, shared prefixes, the verdict and its recommendations."""
    summary = make_table(
        column("requests", justify="right"),
        column("prompt tokens", justify="right"),
        column("ceiling", justify="right"),
        column("after fix", justify="right"),
        column("skipped lines", justify="right"),
        title=f"kvindex analyze: {report.source} (blocks of {report.block_size} tokens)",
        caption=f"ceiling: share of prompt tokens in blocks an earlier request had;"
        f" {report.wall_s:.1f} s",
    )
    summary.add_row(
        f"{report.num_requests:,}",
        f"{report.prompt_tokens:,}",
        f"{report.cached_fraction_ceiling:.1%}",
        f"{report.cached_fraction_after_fix:.1%}",
        str(report.num_problems),
    )
    console.print(summary)
    if report.fragmentation:
        console.print(_findings_table(report))
    if report.top_prefixes:
        console.print(_prefixes_table(report))
    verdict = report.verdict
    console.print(f"verdict: {verdict.policy}: {verdict.reason}")
    for i, step in enumerate(verdict.recommendations, 1):
        console.print(f"  {i}. {step}")
    for problem in report.problems:
        console.print(f"skipped {problem}")
    if report.num_problems > len(report.problems):
        console.print(f"... and {report.num_problems - len(report.problems)} more skipped lines")


def _findings_table(report: AnalysisReport) -> Table:
    table = make_table(
        column("token", justify="right"),
        column("requests", justify="right"),
        column("recoverable", justify="right"),
        column("share", justify="right"),
        column("varying text (examples)"),
        title="fragmentation: a span that differs before content the requests share",
    )
    for f in report.fragmentation:
        table.add_row(
            str(f.token_offset),
            f"{f.requests:,}",
            f"{f.recoverable_tokens:,}",
            f"{f.recoverable_fraction:.1%}",
            " | ".join(repr(_short(t)) for t in f.varying_text),
        )
    return table


def _prefixes_table(report: AnalysisReport) -> Table:
    table = make_table(
        column("tokens", justify="right"),
        column("requests", justify="right"),
        column("share", justify="right"),
        column("start"),
        title="most shared prefixes",
    )
    for p in report.top_prefixes:
        table.add_row(str(p.tokens), f"{p.requests:,}", f"{p.share:.1%}", repr(_short(p.start)))
    return table


def plot(report: AnalysisReport, path: Path) -> None:
    """Share of prompt tokens cacheable by position, before and after the fix (PNG)."""
    plt = pyplot()
    points = report.cacheable_by_position
    xs = [p.token_offset for p in points]
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.plot(xs, [p.cacheable for p in points], label="as logged", drawstyle="steps-post")
    ax.plot(
        xs,
        [p.cacheable_after_fix for p in points],
        label="after the fix (varying spans moved after the shared content)",
        drawstyle="steps-post",
        linestyle="--",
    )
    ax.set_xlabel("token position in the prompt")
    ax.set_ylabel("share of prompt tokens cacheable")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="best")
    ax.set_title(
        f"kvindex analyze: {report.source}: ceiling {report.cached_fraction_ceiling:.1%},"
        f" after the fix {report.cached_fraction_after_fix:.1%}; verdict {report.verdict.policy}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
