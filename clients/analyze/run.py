"""``kvindex analyze``: read a request log, tokenize it, walk it through one cache, report."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
from rich.console import Console

from kvindex.clients.analyze.batches import BATCH_REQUESTS, tokenized_in_batches
from kvindex.clients.analyze.cache_walk import CacheWalk
from kvindex.clients.analyze.report import AnalysisReport, build_report
from kvindex.clients.analyze.table import plot, print_report
from kvindex.clients.workloads.request_log import (
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
    """Tokens per KV-cache block (vLLM's default)."""
    limit: int | None = None
    """Read at most this many requests."""
    tokenize_batch: int = BATCH_REQUESTS
    """Requests per call of a local tokenizer (1: one call per request; a
    ``--tokenizer-url`` is always asked one request at a time)."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise RequestLogError(f"block size must be >= 1, got {self.block_size}")
        if self.tokenize_batch < 1:
            raise RequestLogError(f"tokenize batch must be >= 1, got {self.tokenize_batch}")
        if self.limit is not None and self.limit < 1:
            raise RequestLogError(f"limit must be >= 1, got {self.limit}")


async def analyze_log(
    path: Path, settings: AnalyzeSettings, client: httpx.AsyncClient | None = None
) -> AnalysisReport:
    """The report of the log at ``path``. Bad lines are skipped and listed in the report
    (the first :attr:`Problems.keep`, all counted); raises :class:`RequestLogError` when the
    log or the tokenizer is unusable.
    ``client``: the HTTP client of a ``--tokenizer-url`` (default: one of its own)."""
    started = time.perf_counter()
    problems = Problems()
    walk = CacheWalk(settings.block_size)
    async with LogTokenizer(settings.tokenizer, client) as tokenizer:
        requests = read_request_log(path, problems)
        walk_s = 0.0
        stream = tokenized_in_batches(
            requests, tokenizer, problems, batch_size=settings.tokenize_batch, limit=settings.limit
        )
        async with aclosing(stream):
            async for done in stream:
                walk_started = time.perf_counter()
                walk.add(done.request.model, done.tokens)
                walk_s += time.perf_counter() - walk_started
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


def analyze_main(
    path: Path,
    settings: AnalyzeSettings,
    *,
    console: Console,
    json_path: Path | None = None,
    plot_path: Path | None = None,
) -> AnalysisReport:
    """The command: the tables, then ``--json`` and ``--plot``."""
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
