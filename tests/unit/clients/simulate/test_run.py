"""kvindex.clients.simulate.run: the references and what is reported per policy, on small
runs (no services: the scorer and the indexer's pipeline in process)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from kvindex.clients.simulate.fleet import FleetSettings
from kvindex.clients.simulate.routing import parse_policy
from kvindex.clients.simulate.run import (
    DEFAULT_POLICIES,
    POLICY_COLOURS,
    SimReport,
    SimulateSettings,
    fleet_caption,
    plot,
    policy_colours,
    report_table,
    run_simulation,
)
from kvindex.clients.workloads.generators import WORKLOADS, GeneratorSettings
from kvindex.clients.workloads.trace import read_trace

SMALL = FleetSettings(replicas=4, capacity_blocks=1024)


def test_no_policy_beats_the_ceiling_on_chats_whose_answers_are_reused() -> None:
    requests = WORKLOADS["multi_turn"](GeneratorSettings(requests=300, seed=3))
    policies = tuple(parse_policy(p) for p in ("round_robin", "kv_aware", "kv_aware_instant"))
    report = run_simulation(SimulateSettings(SMALL, policies), requests)
    assert max(p.hit_rate for p in report.policies) <= report.ceiling_hit_rate


def table_rows(report: SimReport) -> dict[str, list[str]]:
    """The printed table, 80 columns wide: each row's cells by its first cell."""
    out = io.StringIO()
    Console(file=out, width=80, no_color=True).print(report_table(report))
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80
    body = lines[next(i for i, line in enumerate(lines) if set(line) == {"─"}) + 1 :]
    rows = {line[:18].strip(): line[18:].split() for line in body}
    return {label: cells for label, cells in rows.items() if cells[:1] and cells[0][-1] == "%"}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("workload", ["system_prompts", "multi_turn", "rag", "few_shot"])
def test_no_policy_beats_the_oracle_the_table_shows(workload: str, seed: int) -> None:
    """Small caches, where a greedy policy with perfect knowledge is often beaten."""
    requests = WORKLOADS[workload](GeneratorSettings(requests=120, seed=seed))
    names = ("session_affinity", "prefix_hash", "kv_aware", "kv_aware_instant")
    fleet = FleetSettings(replicas=4, capacity_blocks=256)
    report = run_simulation(SimulateSettings(fleet, tuple(map(parse_policy, names))), requests)
    rows = table_rows(report)
    oracle = float(rows["oracle"][0].rstrip("%"))
    assert all(float(rows[name][0].rstrip("%")) <= oracle for name in names)
    assert max(p.hit_rate for p in report.policies) <= report.ceiling_hit_rate


def test_the_default_table_fits_80_columns() -> None:
    requests = WORKLOADS["multi_turn"](GeneratorSettings(requests=120, seed=0))
    settings = SimulateSettings(FleetSettings(replicas=4, capacity_blocks=256))
    rows = table_rows(run_simulation(settings, requests))
    assert list(rows) == [*DEFAULT_POLICIES, "oracle", "one LRU cache"]


def test_a_trace_sharing_its_first_block_is_spread_by_session_affinity(tmp_path: Path) -> None:
    """Every request starts with the same system-prompt block (id 0): sessions taken from
    the first block would put all of them on one replica (imbalance = replicas)."""
    rows = [
        {"timestamp": 100 * i, "input_length": 600, "output_length": 4, "hash_ids": [0, 10 + i]}
        for i in range(64)
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = SimulateSettings(SMALL, (parse_policy("session_affinity"),))
    stats = run_simulation(settings, read_trace(path)).stats("session_affinity")
    assert stats.imbalance < 2.0  # 4.0 if every request went to one replica


def test_every_figure_the_practice_watches_is_reported(tmp_path: Path) -> None:
    requests = WORKLOADS["system_prompts"](GeneratorSettings(requests=80, seed=1))
    policies = tuple(parse_policy(p) for p in ("least_load", "kv_aware", "kv_aware_instant"))
    report = run_simulation(SimulateSettings(SMALL, policies), requests, source="test")
    for p in report.to_json()["policies"]:
        assert p["throughput_rps"] > 0 and p["throughput_tps"] > p["output_tps"] > 0
        assert 0 < p["kv_usage_mean"] <= p["kv_usage_p90"] <= 1
        assert p["gpu_s_per_request"] == pytest.approx(
            p["prefill_gpu_s_per_request"] + p["decode_gpu_s_per_request"]
        )
        assert p["prefill_gpu_s_per_request"] > 0
    png = tmp_path / "sim.png"
    plot(report, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_policy_keeps_its_colour_and_variants_get_their_own() -> None:
    labels = [*DEFAULT_POLICIES, "kv_aware:waiting=1", "kv_aware:cache=2"]
    colours = policy_colours(labels)
    assert all(colours[p] == POLICY_COLOURS[p] for p in DEFAULT_POLICIES)
    assert len(set(colours.values())) == len(labels)
    assert colours["kv_aware"] != colours["kv_aware_instant"]


def test_the_subtitle_names_the_fleet() -> None:
    report_params = {"requests": 80, **vars_of(SMALL), "event_delay_s": 0.05}
    caption = fleet_caption(report_params)
    assert "80 requests · 4 replicas x 1,024 blocks of 16 tokens" in caption
    assert "prefill 12,000 tok/s" in caption and "events 0.05 s late" in caption


def vars_of(fleet: FleetSettings) -> dict[str, object]:
    return {name: getattr(fleet, name) for name in fleet.__slots__}
