"""``kvindex simulate`` end to end: the command, its outputs, and events over real ZeroMQ."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvindex.clients.cli.main import main
from kvindex.clients.simulate.fleet import FleetSettings
from kvindex.clients.simulate.routing import parse_policy
from kvindex.clients.simulate.run import SimulateSettings, run_simulation
from kvindex.clients.workloads.generators import WORKLOADS, GeneratorSettings

TRACE = Path(__file__).parents[2] / "bench/traces/mooncake_fast25_synthetic_trace.jsonl.gz"
SMALL = FleetSettings(replicas=4, capacity_blocks=2048)
JSON_FIELDS = {
    "policy",
    "hit_rate",
    "prefill_tokens",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "queue_mean",
    "queue_max",
    "imbalance",
    "throughput_rps",
    "throughput_tps",
    "output_tps",
    "kv_usage_mean",
    "kv_usage_p90",
    "gpu_s_per_request",
    "prefill_gpu_s_per_request",
    "decode_gpu_s_per_request",
}


def test_simulate_a_trace_writes_the_table_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    args = ["simulate", "--trace", str(TRACE), "--limit", "150", "--replicas", "4"]
    args += ["--capacity-blocks", "8192", "--json", str(out), "--plot", str(png)]
    args += ["--variant", "kv_aware:waiting=1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "ceiling hit rate" in result.output and "single-cache hit rate" in result.output
    report = json.loads(out.read_text())
    labels = [p["policy"] for p in report["policies"]]
    assert labels == [
        "round_robin",
        "random",
        "least_load",
        "session_affinity",
        "prefix_hash",
        "kv_aware",
        "oracle",
        "kv_aware:waiting=1",
    ]
    for policy in report["policies"]:
        assert set(policy) >= JSON_FIELDS
        assert 0.0 <= policy["hit_rate"] <= report["ceiling_hit_rate"] <= 1.0
    assert 0.0 <= report["single_cache_hit_rate"] <= report["ceiling_hit_rate"]
    assert report["params"]["replicas"] == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_piped_prints_whole_rows() -> None:
    """Not a terminal (as in ``kvindex simulate ... | cat``): one line per policy, every
    value whole, however long the labels."""
    variant = "kv_aware:waiting=0.5,cache=2,load_half_life_s=10"
    args = ["simulate", "--workload", "multi_turn", "--requests", "60", "--replicas", "2"]
    args += ["--policies", "round_robin,session_affinity,kv_aware", "--variant", variant]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    assert "━" in result.stderr and "━" not in result.stdout  # progress: stderr, not the pipe
    lines = result.stdout.splitlines()
    rows = lines[next(i for i, line in enumerate(lines) if set(line) == {"─"}) + 1 :]
    for label in ("round_robin", "session_affinity", "kv_aware", variant):
        cells = next(line for line in rows if line.split()[:1] == [label])
        hit_rate, *times = cells.split()[1:5]
        assert hit_rate.endswith("%")
        assert all(len(t.split(".")[1]) == 3 for t in times)  # TTFT p50/p90/p99: 0.123
        queue, kv = cells.split()[7:9]
        assert float(queue.split("/")[0]) >= 0 and queue.split("/")[1].isdigit()  # mean/max
        assert kv.count("%") == 2  # KV-cache usage mean/p90
        assert len(cells.split()) == 12  # policy + 11 figures, none wrapped away


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "exactly one of --trace"),
        (["--workload", "unique", "--policies", "best"], "not one of"),
        (["--workload", "unique", "--capacity-blocks", "0"], "capacity_blocks"),
        (["--workload", "unique", "--speed", "0"], "speed"),
        (["--workload", "unique", "--event-delay", "-1"], "event delay"),
        (["--workload", "unique", "--load-interval", "-1"], "load interval"),
        (
            ["--workload", "unique", "--requests", "5", "--json", "/nonexistent/x.json"],
            "cannot write",
        ),
    ],
)
def test_simulate_refuses_bad_arguments(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["simulate", *args])
    assert result.exit_code != 0
    assert message in result.output


def test_kv_aware_beats_round_robin_on_chats() -> None:
    requests = WORKLOADS["multi_turn"](GeneratorSettings(requests=600, seed=2))
    policies = tuple(parse_policy(p) for p in ("round_robin", "kv_aware", "oracle"))
    report = run_simulation(SimulateSettings(SMALL, policies), requests)
    rr, kv, oracle = (report.stats(p) for p in ("round_robin", "kv_aware", "oracle"))
    assert kv.hit_rate >= 1.2 * rr.hit_rate
    assert kv.hit_rate >= 0.9 * oracle.hit_rate
    assert max(p.hit_rate for p in report.policies) <= report.ceiling_hit_rate


@pytest.mark.timeout(120)
def test_events_over_zeromq_give_the_same_decisions_as_in_process() -> None:
    """The indexer fed over real sockets (vLLM wire format, bound SUB on loopback) ends in
    the same index at every decision, so the run is identical."""
    requests = WORKLOADS["multi_turn"](GeneratorSettings(requests=150, seed=5))
    policies = (parse_policy("kv_aware"),)
    local = run_simulation(SimulateSettings(SMALL, policies), requests)
    remote = run_simulation(SimulateSettings(SMALL, policies, via_zmq=True), requests)
    a, b = local.stats("kv_aware"), remote.stats("kv_aware")
    assert a.hit_rate > 0.3
    assert (b.hit_rate, b.prefill_tokens, b.ttft_p90_s) == (
        a.hit_rate,
        a.prefill_tokens,
        a.ttft_p90_s,
    )
