"""``kvindex simulate`` end to end: the command, its outputs, and events over real ZeroMQ."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvindex.clients.cli.main import main
from kvindex.clients.cli.offline import simulate
from kvindex.clients.simulate.fleet import FleetSettings
from kvindex.clients.simulate.routing import parse_policy
from kvindex.clients.simulate.run import DEFAULT_POLICIES, SimulateSettings, run_simulation
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
    assert "oracle: one unbounded cache" in result.output and "one LRU cache" in result.output
    report = json.loads(out.read_text())
    labels = [p["policy"] for p in report["policies"]]
    assert labels == [
        "round_robin",
        "random",
        "least_load",
        "session_affinity",
        "prefix_hash",
        "kv_aware",
        "kv_aware_instant",
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
    assert not any(line.startswith("simulate: ") for line in result.stdout.splitlines())
    lines = result.stdout.splitlines()
    rows = lines[next(i for i, line in enumerate(lines) if set(line) == {"─"}) + 1 :]
    for label in ("round_robin", "session_affinity", "kv_aware", variant):
        cells = next(line for line in rows if line.split()[:1] == [label])
        hit_rate, *times = cells.split()[1:5]
        assert hit_rate.endswith("%")
        assert all(len(t.split(".")[1]) == 3 for t in times)  # TTFT p50/p90/p99: 0.123
        queue = cells.split()[5]
        assert float(queue.split("/")[0]) >= 0 and queue.split("/")[1].isdigit()  # mean/max
        assert len(cells.split()) == 8  # policy + 7 figures, none wrapped away


def test_a_long_run_prints_progress_lines_with_an_eta() -> None:
    args = ["simulate", "--workload", "multi_turn", "--requests", "400", "--replicas", "2"]
    args += ["--policies", "round_robin,kv_aware", "--progress-every", "0.01"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    progress = [line for line in result.stderr.splitlines() if line.startswith("simulate: ")]
    assert len(progress) >= 2
    assert not any(line.startswith("simulate: ") for line in result.stdout.splitlines())
    assert re.fullmatch(
        r"simulate: [\d,]+/800 requests \(\d+%\) · (round_robin|kv_aware) · \d+:\d\d elapsed"
        r" · ETA \d+:\d\d",
        progress[0],
    ), progress[0]
    assert progress[-1].startswith("simulate: 800/800 requests (100%)")


def test_cli_defaults_are_the_settings_defaults() -> None:
    """The options carry their defaults as literals (the command imports the simulator
    only when it runs): they must be the settings' own."""
    params = {p.name: p for p in simulate.params}
    for name in ("replicas", "capacity_blocks", "block_size", "prefill_tps", "decode_tps"):
        assert params[name].default == getattr(FleetSettings(), name), name
    assert params["max_running"].default == FleetSettings().max_running
    assert params["policies"].default == ",".join(DEFAULT_POLICIES)
    workload = params["workload"].type
    assert isinstance(workload, click.Choice) and list(workload.choices) == sorted(WORKLOADS)


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
    names = ("round_robin", "kv_aware", "kv_aware_instant")
    report = run_simulation(SimulateSettings(SMALL, tuple(map(parse_policy, names))), requests)
    rr, kv, instant = (report.stats(p) for p in names)
    assert kv.hit_rate >= 1.2 * rr.hit_rate
    assert kv.hit_rate >= 0.9 * instant.hit_rate
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
