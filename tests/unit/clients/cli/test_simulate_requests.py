"""``kvindex simulate --request-log LOG``: the user's own traffic through every policy."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from kvindex.clients.cli.main import main
from kvindex.clients.simulate.run import DEFAULT_POLICIES
from tests.support import request_logs as samples
from tests.support.request_logs import make_tokenizer, write_log


def test_a_request_log_runs_through_every_policy(tmp_path: Path) -> None:
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    rows: list[object] = [*samples.multi_turn(num_chats=6, turns=4)]
    rows.insert(2, "{broken")
    log = write_log(tmp_path / "requests.jsonl", rows)
    out = tmp_path / "sim.json"
    args = ["simulate", "--request-log", str(log), "--tokenizer", str(tokenizer)]
    args += ["--replicas", "2", "--rate", "5", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "skipped line 3: not JSON" in result.stderr
    report = json.loads(out.read_text())
    assert [p["policy"] for p in report["policies"]] == list(DEFAULT_POLICIES)
    assert report["params"]["source"] == "requests.jsonl"
    assert all(p["requests"] == 24 for p in report["policies"])
    by_policy = {p["policy"]: p for p in report["policies"]}
    assert by_policy["kv_aware"]["hit_rate"] > 0.3  # the chats' histories are reused


def test_timestamps_set_the_arrivals(tmp_path: Path) -> None:
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    log = write_log(tmp_path / "requests.jsonl", samples.timestamped_rules(12))
    out = tmp_path / "sim.json"
    args = ["simulate", "--request-log", str(log), "--tokenizer", str(tokenizer)]
    args += ["--replicas", "2", "--policies", "least_load", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    timeline = json.loads(out.read_text())["policies"][0]["hit_rate_timeline"]
    assert timeline[-1][0] <= 11.0  # 12 requests one second apart


def test_requests_is_a_count_and_a_log_is_request_log(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["simulate", "--workload", "unique", "--requests", "x.jsonl"])
    assert result.exit_code == 2 and "a number of requests" in result.output
    result = runner.invoke(main, ["simulate"])
    assert result.exit_code == 2 and "exactly one of" in result.output
    assert "--request-log" in result.output
    result = runner.invoke(main, ["simulate", "--requests", str(tmp_path / "none.jsonl")])
    assert result.exit_code == 2 and "--request-log PATH" in result.output
    result = runner.invoke(main, ["simulate", "--request-log", str(tmp_path / "none.jsonl")])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_the_old_requests_log_form_still_runs_and_names_the_new_option(tmp_path: Path) -> None:
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    log = write_log(tmp_path / "requests.jsonl", samples.timestamped_rules(6))
    args = ["simulate", "--requests", str(log), "--tokenizer", str(tokenizer)]
    result = CliRunner().invoke(main, [*args, "--replicas", "2", "--policies", "least_load"])
    assert result.exit_code == 0, result.output
    assert f"use --request-log {log}" in result.stderr
    assert "least_load" in result.stdout and "warning" not in result.stdout
