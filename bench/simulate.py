"""Simulation benchmark: the Mooncake synthetic trace through ``kvindex simulate``'s fleet.

Usage (from the repository root)::

    .venv/bin/python bench/simulate.py            # the whole trace
    .venv/bin/python bench/simulate.py --quick    # its first 1,000 requests
    .venv/bin/python bench/simulate.py --capacity-blocks 32768 --policies kv_aware

Every policy over a fresh fleet, then the references (the oracle, one LRU cache); then the
unique-prompt generator under ``least_load`` and ``kv_aware`` (where routing by cache cannot
help and must not hurt). One JSON line per policy, then a summary line per workload with the
checks: kv_aware's hit rate against ``kv_aware_instant``'s, the oracle's and round_robin's,
whether its TTFT p90 is the lowest of the others, and on unique prompts its TTFT p90 against
least_load's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvindex.clients.simulate.fleet import FleetSettings
from kvindex.clients.simulate.routing import INSTANT, parse_policy
from kvindex.clients.simulate.run import (
    DEFAULT_POLICIES,
    SimReport,
    SimulateSettings,
    run_simulation,
)
from kvindex.clients.workloads.generators import WORKLOADS, GeneratorSettings
from kvindex.clients.workloads.trace import read_trace

TRACE = Path(__file__).parent / "traces/mooncake_fast25_synthetic_trace.jsonl.gz"


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--quick", action="store_true", help="the first 1,000 requests")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--capacity-blocks", type=int, default=FleetSettings().capacity_blocks)
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    parser.add_argument("--unique-requests", type=int, default=3000)
    return parser.parse_args(argv)


def _emit(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


def _policy_lines(workload: str, report: SimReport) -> None:
    for stats in report.policies:
        line = {"bench": "simulate", "workload": workload, **asdict(stats)}
        del line["hit_rate_timeline"]
        _emit(line)


def trace_checks(report: SimReport) -> dict[str, Any]:
    labels = {p.policy for p in report.policies}
    if not {"kv_aware", INSTANT, "round_robin"} <= labels:
        return {}
    kv, instant, rr = (report.stats(x) for x in ("kv_aware", INSTANT, "round_robin"))
    others = [p for p in report.policies if p.policy not in ("kv_aware", INSTANT)]
    oracle = report.ceiling_hit_rate
    return {
        "kv_aware_vs_instant_hit": kv.hit_rate / instant.hit_rate if instant.hit_rate else None,
        "kv_aware_vs_oracle_hit": kv.hit_rate / oracle if oracle else None,
        "kv_aware_vs_round_robin_hit": kv.hit_rate / rr.hit_rate if rr.hit_rate else None,
        "kv_aware_lowest_ttft_p90": all(kv.ttft_p90_s <= p.ttft_p90_s for p in others),
        "best_other_ttft_p90_s": min((p.ttft_p90_s for p in others), default=None),
    }


def unique_checks(report: SimReport) -> dict[str, Any]:
    kv, ll = report.stats("kv_aware"), report.stats("least_load")
    return {"kv_aware_vs_least_load_ttft_p90": kv.ttft_p90_s / ll.ttft_p90_s}


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    fleet = FleetSettings(replicas=args.replicas, capacity_blocks=args.capacity_blocks)
    policies = tuple(parse_policy(p) for p in args.policies.split(","))
    started = time.perf_counter()
    requests = read_trace(args.trace, limit=1000 if args.quick else None)
    report = run_simulation(SimulateSettings(fleet, policies), requests, source=args.trace.name)
    _policy_lines("mooncake", report)
    _emit(
        {
            "bench": "simulate",
            "workload": "mooncake",
            "requests": len(requests),
            "ceiling_hit_rate": report.ceiling_hit_rate,
            "single_cache_hit_rate": report.single_cache_hit_rate,
            "wall_s": report.wall_s,
            "checks": trace_checks(report),
        }
    )
    unique = WORKLOADS["unique"](GeneratorSettings(requests=args.unique_requests))
    pair = tuple(parse_policy(p) for p in ("least_load", "kv_aware"))
    report = run_simulation(SimulateSettings(fleet, pair), unique, source="unique")
    _policy_lines("unique", report)
    _emit(
        {
            "bench": "simulate",
            "workload": "unique",
            "requests": len(unique),
            "wall_s": report.wall_s,
            "checks": unique_checks(report),
            "total_wall_s": time.perf_counter() - started,
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
