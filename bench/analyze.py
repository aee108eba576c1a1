"""``kvindex analyze`` benchmark: a production-sized request log, read, tokenized and analysed.

Usage (from the repository root)::

    .venv/bin/python bench/analyze.py              # 100,000 requests of ~2,000 tokens
    .venv/bin/python bench/analyze.py --quick      # 10,000 requests
    .venv/bin/python bench/analyze.py --tokenize-batch 1   # one tokenizer call per request

The log (gzip, one chat request a line, with a timestamp) is generated first: 16 apps,
Zipf-popular, each with a system prompt of ~1,600 tokens; the two most popular put the
current time before their rules (the fragmentation the analysis must find); each user turn
is ~400 tokens, unique. Tokenized in-process by a byte-level BPE trained here (600 tokens:
about one token per word of this text, so a 2,000-token prompt is ~10,000 characters).

Prints one JSON line: ``{"bench": "analyze", "requests", "prompt_tokens", "wall_s",
"read_and_tokenize_s", "walk_s", "report_s", "cpu_s", "requests_per_s", "tokens_per_s",
"peak_rss_mb", "cached_fraction_ceiling", "cached_fraction_after_fix", "findings",
"top_finding_requests", "verdict", "generate_s"}``. ``cpu_s`` is the process's CPU time (all
threads): on a loaded host, the figure to compare with "minutes on one core"; the wall
time includes waiting for the CPU. Texts are tokenized ``--tokenize-batch`` at a time (64)
in one call of the library, in a worker thread and in parallel over the cores, so with free
cores the wall time can be shorter than ``cpu_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

from kvindex.clients.analyze.batches import BATCH_REQUESTS
from kvindex.clients.analyze.run import AnalyzeSettings, analyze_log
from kvindex.clients.workloads.request_log import TokenizerOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test support's tokenizer
from tests.support.request_logs import WORDS, make_tokenizer

APPS = 16
SYSTEM_WORDS = 1_600
USER_PIECE_WORDS = 200
USER_PIECES = 2_000
TIMESTAMPED_APPS = 2


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, k=n))


def write_log(path: Path, num_requests: int, seed: int = 0) -> None:
    """The benchmark's log (see the module's docstring), gzip."""
    rng = random.Random(seed)
    systems = [_words(rng, SYSTEM_WORDS) for _ in range(APPS)]
    pieces = [_words(rng, USER_PIECE_WORDS) for _ in range(USER_PIECES)]
    weights = [1 / (i + 1) for i in range(APPS)]
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as out:
        for i in range(num_requests):
            app = rng.choices(range(APPS), weights)[0]
            t = 1_796_000_000 + i * 0.05
            system = systems[app]
            if app < TIMESTAMPED_APPS:
                stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
                system = f"Current time: {stamp}\n{system}"
            user = f"{rng.choice(pieces)} {rng.choice(pieces)} ticket {i}"
            messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            out.write(json.dumps({"timestamp": t, "model": "m", "messages": messages}) + "\n")


def _cpu_s() -> float:
    """CPU seconds of this process, every thread (the tokenizer's worker threads too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--quick", action="store_true", help="10,000 requests")
    parser.add_argument("--tokenize-batch", type=int, default=BATCH_REQUESTS)
    args = parser.parse_args(argv)
    num_requests = 10_000 if args.quick else args.requests
    with tempfile.TemporaryDirectory() as tmp:
        log, tokenizer = Path(tmp) / "requests.jsonl.gz", Path(tmp) / "tokenizer.json"
        started = time.perf_counter()
        make_tokenizer(tokenizer)
        write_log(log, num_requests)
        generate_s = time.perf_counter() - started
        settings = AnalyzeSettings(
            TokenizerOptions(path=tokenizer), tokenize_batch=args.tokenize_batch
        )
        cpu_started = _cpu_s()
        report = asyncio.run(analyze_log(log, settings))
        cpu_s = _cpu_s() - cpu_started
    top = report.fragmentation[0] if report.fragmentation else None
    line = {
        "bench": "analyze",
        "requests": report.num_requests,
        "prompt_tokens": report.prompt_tokens,
        "wall_s": round(report.wall_s, 1),
        **{name: round(value, 1) for name, value in report.timings.items()},
        "cpu_s": round(cpu_s, 1),
        "requests_per_s": round(report.num_requests / report.wall_s),
        "tokens_per_s": round(report.prompt_tokens / report.wall_s),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "cached_fraction_ceiling": round(report.cached_fraction_ceiling, 4),
        "cached_fraction_after_fix": round(report.cached_fraction_after_fix, 4),
        "findings": len(report.fragmentation),
        "top_finding_requests": top.requests if top else 0,
        "verdict": report.verdict.policy,
        "generate_s": round(generate_s, 1),
    }
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
