"""``kvindex demo`` end to end: sims, indexer and API in-process, on loopback."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from click.testing import CliRunner

from kvindex.clients.cli.main import main
from kvindex.clients.cli.offline import demo
from kvindex.clients.demo import POLICIES, DemoSettings, build_workload, run_demo

SMALL = DemoSettings(replicas=3, requests=60, speed=100.0, concurrency=8)


def test_workload_is_deterministic_and_sized() -> None:
    first, second = build_workload(SMALL), build_workload(SMALL)
    assert first == second
    assert sum(len(s.turns) for s in first) == SMALL.requests
    assert {s.chat for s in first} == {True, False}


def test_kv_aware_beats_round_robin_and_stops_everything() -> None:
    before = set(threading.enumerate())
    report = run_demo(SMALL)
    by_policy = {p.policy: p for p in report.policies}
    assert tuple(by_policy) == POLICIES
    for p in report.policies:
        assert p.num_requests == SMALL.requests
        assert sum(p.requests_per_replica.values()) == SMALL.requests
        assert p.prefill_tokens == p.prompt_tokens - p.cached_tokens
        assert 0 < p.ttft_p50_s <= p.ttft_p90_s and p.ttft_mean_s > 0
        assert 0 <= p.num_waited <= p.num_requests
    assert by_policy["kv_aware"].hit_rate > by_policy["round_robin"].hit_rate
    assert set(threading.enumerate()) <= before, "the demo left threads running"


def test_the_same_seed_gives_the_same_figures() -> None:
    first, second = run_demo(SMALL), run_demo(SMALL)
    assert [p.figures() for p in first.policies] == [p.figures() for p in second.policies]


def test_cli_demo_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    out = tmp_path / "demo.json"
    result = CliRunner().invoke(
        main,
        ["demo", "--replicas", "2", "--requests", "30", "--speed", "100", "--json", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert "hit rate" in result.stdout and "…" not in result.output
    assert "━" in result.stderr and "━" not in result.stdout  # progress: stderr, not the pipe
    for policy in POLICIES:  # not a terminal: one whole line per policy
        cells = next(line for line in result.stdout.splitlines() if line.startswith(policy))
        assert "%" in cells and cells.count(" ms") == 2 and "r1:" in cells and "r2:" in cells
    assert "every other figure is the same on every run with seed 0" in result.stdout
    words = " ".join(result.stdout.split())
    assert "TTFT: simulated time from a round's start to a request's first token" in words
    assert "Requests that waited to be admitted: round_robin " in words
    body = json.loads(out.read_text())
    assert set(body["policies"]) == set(POLICIES)
    assert set(threading.enumerate()) <= before, "the demo left threads running"


def test_cli_defaults_are_the_settings_defaults() -> None:
    """Literals in the options (the command imports the demo only when it runs)."""
    defaults = DemoSettings()
    for param in demo.params:
        if param.name in ("replicas", "requests", "seed", "speed"):
            assert param.default == getattr(defaults, param.name), param.name
