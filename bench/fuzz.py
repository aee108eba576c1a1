"""The long fuzz run of the write path: ``tests/support/frame_fuzz.py``'s properties over
as many hypothesis cases as asked (the CI test runs a few hundred).

Usage (from the repository root)::

    .venv/bin/python bench/fuzz.py --cases 100000             # ~15 min on 2 workers
    .venv/bin/python bench/fuzz.py --cases 2000 --workers 1

Each case is one hypothesis example: a list of live messages (``check_live``) or of replay
replies (``check_replay``), in jobs of 5,000 cases (three live jobs to one replay job), each
with its own random seed; stderr shows the progress. Prints one JSON line: cases run,
frames fed, seconds and the result (``pass``, or ``fail`` with the shrunk counterexample's
error). Exit 1 on a failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, given, settings

from tests.support.frame_fuzz import Message, Reply, check_live, check_replay, messages, replies

MAX_MESSAGES = 3
"""Messages (or replies) per case: shorter cases than the CI test's (12), so that 10**5 of
them fit in a few minutes; the CI test covers the longer histories."""


def _run(kind: str, cases: int) -> dict[str, object]:
    """Run ``cases`` examples of one property; its counts and result."""
    counts = {"cases": 0, "frames": 0}
    config = settings(
        max_examples=cases,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )

    @config
    @given(batch=messages(max_size=MAX_MESSAGES))
    def live(batch: list[Message]) -> None:
        counts["cases"] += 1
        counts["frames"] += len(batch)
        check_live(batch)

    @config
    @given(found=replies(max_size=MAX_MESSAGES))
    def replay(found: list[Reply]) -> None:
        counts["cases"] += 1
        counts["frames"] += len(found)
        check_replay(found)

    result: dict[str, object] = {"result": "pass"}
    try:
        (live if kind == "live" else replay)()
    except Exception as exc:  # the counterexample, shrunk, is the report
        lines = traceback.format_exception_only(exc)
        result = {"result": "fail", "error": "".join(lines).strip()[-2000:]}
    return {**counts, **result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the pipeline logs each first bad frame per stream
    jobs = _split(args.cases)
    started = time.perf_counter()
    results = []
    with ProcessPoolExecutor(args.workers) as pool:
        for done in pool.map(_run_job, jobs):
            results.append(done)
            print(f"{sum(int(str(r['cases'])) for r in results)} cases done", file=sys.stderr)
    failures = [r for r in results if r["result"] != "pass"]
    line = {
        "cases": sum(int(str(r["cases"])) for r in results),
        "frames": sum(int(str(r["frames"])) for r in results),
        "seconds": round(time.perf_counter() - started, 1),
        "workers": args.workers,
        "result": "fail" if failures else "pass",
    }
    if failures:
        line["errors"] = [f["error"] for f in failures]
    print(json.dumps(line))
    return 1 if failures else 0


CHUNK = 5_000
"""Cases per job (each job a fresh seed), so progress shows and the workers stay busy."""


def _split(cases: int) -> list[tuple[str, int]]:
    """Jobs of at most :data:`CHUNK` cases, one replay job to three live ones."""
    jobs = []
    for number, start in enumerate(range(0, cases, CHUNK)):
        jobs.append(("replay" if number % 4 == 3 else "live", min(CHUNK, cases - start)))
    return jobs


def _run_job(job: tuple[str, int]) -> dict[str, object]:
    logging.disable(logging.WARNING)
    return _run(*job)


if __name__ == "__main__":
    sys.exit(main())
