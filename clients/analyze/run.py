"""``kvindex analyze``: read a request log, tokenize it, walk it through one cache, report."""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from collections.abc import Iterator
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
from rich.console import Console

from kvindex.clients.analyze.batches import BATCH_REQUESTS, tokenized_in_batches
from kvindex.clients.analyze.cache_walk import CacheWalk
from kvindex.clients.analyze.report import AnalysisReport, build_report
from kvindex.clients.analyze.table import plot, print_report
from kvindex.clients.plotting import pyplot
from kvindex.clients.progress import ProgressLog
from kvindex.clients.workloads.request_log import (
    LoggedRequest,
    LogTokenizer,
    Problems,
    RequestLogError,
    TokenizerOptions,
    read_request_log,
)


@dataclass(frozen=True, slots=True)
class AnalyzeSettings:
    tokenizer: TokenizerOptions
    block_size: int = 16
    limit: int | None = None
    tokenize_batch: int = BATCH_REQUESTS
    """Requests per call of a local tokenizer (1: one call per request)."""
    progress_every_s: float = 0.0
    """Seconds between progress lines on stderr (0: none)."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise RequestLogError(f"block size must be >= 1, got {self.block_size}")
        if self.tokenize_batch < 1:
            raise RequestLogError(f"tokenize batch must be >= 1, got {self.tokenize_batch}")
        if self.limit is not None and self.limit < 1:
            raise RequestLogError(f"limit must be >= 1, got {self.limit}")
        if not self.progress_every_s >= 0:
            raise RequestLogError(f"progress interval must be >= 0 s, got {self.progress_every_s}")


async def analyze_log(
    path: Path, settings: AnalyzeSettings, client: httpx.AsyncClient | None = None
) -> AnalysisReport:
    """The report of the log at ``path`` (bad lines skipped and listed); raises
    :class:`RequestLogError` when the log or the tokenizer is unusable."""
    started = time.perf_counter()
    problems = Problems()
    walk = CacheWalk(settings.block_size)
    progress = _progress(path, settings)
    async with LogTokenizer(settings.tokenizer, client) as tokenizer:
        requests = _counted(read_request_log(path, problems), progress)
        walk_s = 0.0
        stream = tokenized_in_batches(
            requests, tokenizer, problems, batch_size=settings.tokenize_batch, limit=settings.limit
        )
        async with aclosing(stream):
            async for done in stream:
                walk_started = time.perf_counter()
                walk.add(done.request.model, done.tokens)
                walk_s += time.perf_counter() - walk_started
        progress.finish()
        if not walk.num_requests:
            raise RequestLogError(f"{path}: no request could be read ({problems.count} skipped)")
        read_s = time.perf_counter() - started - walk_s
        report = await build_report(
            walk, tokenizer.decode, source=path.name, problems=(problems.count, problems.kept)
        )
    report_s = time.perf_counter() - started - read_s - walk_s
    return replace(
        report,
        wall_s=time.perf_counter() - started,
        timings={"read_and_tokenize_s": read_s, "walk_s": walk_s, "report_s": report_s},
    )


def _progress(path: Path, settings: AnalyzeSettings) -> ProgressLog:
    # counting the lines first is cheap beside tokenizing them
    total = count_lines(path) if settings.progress_every_s > 0 else 0
    if settings.limit is not None:
        total = min(total, settings.limit)
    return ProgressLog("analyze", total, every_s=settings.progress_every_s, unit="lines")


def _counted(requests: Iterator[LoggedRequest], progress: ProgressLog) -> Iterator[LoggedRequest]:
    for request in requests:
        progress.advance(request.line - progress.done)
        yield request


def count_lines(path: Path) -> int:
    try:
        with path.open("rb") as probe:
            gzipped = probe.read(2) == b"\x1f\x8b"
        count, last = 0, b"\n"
        with gzip.open(path, "rb") if gzipped else path.open("rb") as lines:
            for chunk in iter(lambda: lines.read(1 << 20), b""):
                count, last = count + chunk.count(b"\n"), chunk[-1:]
        return count + (last != b"\n")
    except (OSError, EOFError) as exc:
        raise RequestLogError(f"{path}: {exc}") from exc


def analyze_main(
    path: Path,
    settings: AnalyzeSettings,
    *,
    console: Console,
    json_path: Path | None = None,
    plot_path: Path | None = None,
) -> AnalysisReport:
    """The command: the tables, then ``--json`` and ``--plot``."""
    if plot_path is not None:
        pyplot()  # without the extra, say so before the run, not after it
    report = asyncio.run(analyze_log(path, settings))
    print_report(report, console)
    try:
        if json_path is not None:
            json_path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
            console.print(f"wrote {json_path}")
        if plot_path is not None:
            plot(report, plot_path)
            console.print(f"wrote {plot_path}")
    except OSError as exc:
        raise RequestLogError(f"cannot write the results: {exc}") from exc
    return report
