"""``kvindex analyze`` through the command line, as a user runs it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from click.testing import CliRunner

from kvindex.clients.cli.main import main
from tests.support import request_logs as samples
from tests.support.request_logs import make_tokenizer, write_log


def test_analyze_prints_the_report_and_writes_json_and_plot(tmp_path: Path) -> None:
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    rows: list[object] = [*samples.timestamped_rules(40)]
    rows.insert(5, "not json at all")
    log = write_log(tmp_path / "requests.jsonl", rows)
    out_json, out_png = tmp_path / "report.json", tmp_path / "report.png"
    result = CliRunner().invoke(
        main,
        [
            "analyze",
            "--request-log",
            str(log),
            "--tokenizer",
            str(tokenizer),
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "kvindex analyze: requests.jsonl" in result.output
    assert "fragmentation" in result.output
    assert "verdict: least_load" in result.output
    assert "1. fix the prompt structure" in result.output
    assert "skipped line 6: not JSON" in result.output
    report = json.loads(out_json.read_text())
    assert report["num_requests"] == 40 and report["num_problems"] == 1
    assert out_png.stat().st_size > 0


def test_analyze_needs_one_tokenizer_source(tmp_path: Path) -> None:
    log = write_log(tmp_path / "requests.jsonl", samples.unique_prompts(3))
    result = CliRunner().invoke(main, ["analyze", "--request-log", str(log)])
    assert result.exit_code == 1
    assert "give exactly one of --tokenizer FILE or --tokenizer-url URL" in result.output
    assert "Traceback" not in result.output


def test_analyze_of_an_unusable_log_is_a_clear_error(tmp_path: Path) -> None:
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    log = write_log(tmp_path / "requests.jsonl", ["{", "{}"])
    result = CliRunner().invoke(
        main, ["analyze", "--request-log", str(log), "--tokenizer", str(tokenizer)]
    )
    assert result.exit_code == 1
    assert "no request could be read (2 skipped)" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_requests_is_the_old_spelling_of_request_log(tmp_path: Path) -> None:
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    log = write_log(tmp_path / "requests.jsonl", samples.unique_prompts(5))
    runner = CliRunner()
    old = runner.invoke(main, ["analyze", "--requests", str(log), "--tokenizer", str(tokenizer)])
    new = runner.invoke(main, ["analyze", "--request-log", str(log), "--tokenizer", str(tokenizer)])
    assert old.exit_code == new.exit_code == 0, old.output
    warning = f"warning: --requests {log} reads a request log for the last release:"
    assert warning in old.stderr and f"use --request-log {log}" in old.stderr
    assert "warning" not in new.stderr
    assert _timeless(old.stdout) == _timeless(new.stdout)


def _timeless(report: str) -> str:
    """The report less its measured durations (two runs' differ by a tick)."""
    return re.sub(r"\d+(\.\d+)? s\b", "<s>", report)


def test_analyze_takes_the_log_exactly_once(tmp_path: Path) -> None:
    log = write_log(tmp_path / "requests.jsonl", samples.unique_prompts(3))
    runner = CliRunner()
    both = runner.invoke(main, ["analyze", "--request-log", str(log), "--requests", str(log)])
    neither = runner.invoke(main, ["analyze", "--tokenizer-url", "http://127.0.0.1:1"])
    for result in (both, neither):
        assert result.exit_code == 2
        assert "give the log once: --request-log LOG.jsonl" in result.output
