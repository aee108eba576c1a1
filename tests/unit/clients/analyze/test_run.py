"""``kvindex analyze`` on logs of a known structure: what it must find, and must not."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import tokenizers

from kvindex.clients.analyze.report import AnalysisReport
from kvindex.clients.analyze.run import AnalyzeSettings, analyze_log, analyze_main, count_lines
from kvindex.clients.console import make_console
from kvindex.clients.workloads.request_log import LogTokenizer, RequestLogError, TokenizerOptions
from tests.support import request_logs as samples
from tests.support.request_logs import write_log


def analyze(tokenizer: Path, log: Path, **kw: Any) -> AnalysisReport:
    settings = AnalyzeSettings(TokenizerOptions(path=tokenizer), **kw)
    return asyncio.run(analyze_log(log, settings))


def system_blocks(tokenizer: Path, system: str, block_size: int = 16) -> int:
    """Full blocks of the rendered prompt that hold the system message alone."""
    tok = LogTokenizer(TokenizerOptions(path=tokenizer))
    head = asyncio.run(tok.tokens(samples_request(system)))
    return (len(head) - 4) // block_size  # less the next message's marker


def samples_request(system: str) -> Any:
    from kvindex.clients.workloads.request_log import LoggedRequest  # noqa: PLC0415

    return LoggedRequest(1, "m", messages=[{"role": "system", "content": system}])


def test_a_leading_timestamp_is_found_and_its_fix_recovers_most_tokens(
    tokenizer_path: Path, tmp_path: Path
) -> None:
    rows = samples.timestamped_rules(100)
    report = analyze(tokenizer_path, write_log(tmp_path / "log.jsonl", rows))
    assert report.num_requests == 100
    assert report.cached_fraction_ceiling < 0.1
    finding = report.fragmentation[0]
    assert finding.requests >= 95
    assert finding.recoverable_fraction >= 0.8
    assert report.cached_fraction_after_fix >= report.cached_fraction_ceiling + 0.8
    assert finding.token_offset < 32  # near the top, where the timestamp is
    timestamps = [r["messages"][0]["content"].split("\n")[0].split(": ")[1] for r in rows]
    assert finding.varying_text and all(t in timestamps for t in finding.varying_text)
    assert report.verdict.recommendations[0].startswith("fix the prompt structure")
    assert finding.varying_text[0] in report.verdict.recommendations[0]


def test_a_shared_system_prompt_with_varied_questions_is_no_fragmentation(
    tokenizer_path: Path, tmp_path: Path
) -> None:
    rows = samples.shared_system(100)
    report = analyze(tokenizer_path, write_log(tmp_path / "log.jsonl", rows))
    assert report.fragmentation == []
    assert report.cached_fraction_ceiling > 0.8
    assert report.verdict.policy in ("prefix_hash", "kv_aware")
    system = rows[0]["messages"][0]["content"]
    expected = system_blocks(tokenizer_path, system)
    assert report.verdict.prefix_blocks is not None
    assert abs(report.verdict.prefix_blocks - expected) <= 1
    top = report.top_prefixes[0]
    assert top.share == 1.0 and top.start.startswith("<|system|>\n" + system[:20])


def test_several_system_prompts_call_for_prefix_hash(tokenizer_path: Path, tmp_path: Path) -> None:
    rows = samples.several_systems(160, num_systems=8)
    report = analyze(tokenizer_path, write_log(tmp_path / "log.jsonl", rows))
    assert report.fragmentation == []
    assert report.verdict.policy == "prefix_hash"
    shortest = min(system_blocks(tokenizer_path, r["messages"][0]["content"]) for r in rows[:8])
    assert report.verdict.prefix_blocks is not None
    assert 1 <= report.verdict.prefix_blocks <= shortest + 1
    assert "prefix_blocks=" in report.verdict.recommendations[0]
    assert [p.share for p in report.top_prefixes[:8]] == [pytest.approx(1 / 8)] * 8


def test_unique_short_prompts_call_for_least_load(tokenizer_path: Path, tmp_path: Path) -> None:
    report = analyze(tokenizer_path, write_log(tmp_path / "log.jsonl", samples.unique_prompts(100)))
    assert report.cached_fraction_ceiling < 0.05
    assert report.fragmentation == []
    assert report.verdict.policy == "least_load"
    assert report.verdict.recommendations[0].startswith("route with least_load")


def test_multi_turn_chats_reuse_their_history(tokenizer_path: Path, tmp_path: Path) -> None:
    rows = samples.multi_turn(num_chats=12, turns=5)
    report = analyze(tokenizer_path, write_log(tmp_path / "log.jsonl", rows))
    assert report.fragmentation == []
    assert report.cached_fraction_ceiling > 0.5
    assert report.verdict.policy in ("prefix_hash", "kv_aware")
    # The shared system prompt, then each chat's own history (5 turns each).
    assert report.top_prefixes[0].share == 1.0
    assert report.top_prefixes[1].requests == 5


def test_bad_lines_gzip_and_the_body_wrapper(tokenizer_path: Path, tmp_path: Path) -> None:
    rows: list[Any] = [{"body": r} for r in samples.shared_system(20)]
    rows.insert(3, "{oops")
    report = analyze(tokenizer_path, write_log(tmp_path / "log.gz", rows, gz=True))
    assert report.num_requests == 20
    assert report.num_problems == 1
    assert report.problems[0].startswith("line 4: not JSON")


def test_block_size_and_limit(tokenizer_path: Path, tmp_path: Path) -> None:
    log = write_log(tmp_path / "log.jsonl", samples.shared_system(30))
    report = analyze(tokenizer_path, log, block_size=32, limit=10)
    assert (report.num_requests, report.block_size) == (10, 32)
    assert all(p.tokens % 32 == 0 for p in report.top_prefixes)


def test_a_log_with_no_usable_line_is_an_error(tokenizer_path: Path, tmp_path: Path) -> None:
    with pytest.raises(RequestLogError, match="no request could be read"):
        analyze(tokenizer_path, write_log(tmp_path / "log.jsonl", ["{", "[]"]))


def test_json_and_plot_are_written(tokenizer_path: Path, tmp_path: Path) -> None:
    log = write_log(tmp_path / "log.jsonl", samples.timestamped_rules(30))
    settings = AnalyzeSettings(TokenizerOptions(path=tokenizer_path))
    json_path, plot_path = tmp_path / "a.json", tmp_path / "a.png"
    analyze_main(log, settings, console=make_console(), json_path=json_path, plot_path=plot_path)
    data = json.loads(json_path.read_text())
    for name in ("num_requests", "prompt_tokens", "cached_fraction_ceiling", "top_prefixes"):
        assert name in data
    finding = data["fragmentation"][0]
    assert set(finding) == {
        "token_offset",
        "requests",
        "varying_text",
        "recoverable_tokens",
        "recoverable_fraction",
    }
    assert set(data["verdict"]) == {"policy", "reason", "recommendations", "prefix_blocks"}
    points = data["cacheable_by_position"]
    assert points[0]["token_offset"] == 0
    assert max(p["cacheable_after_fix"] - p["cacheable"] for p in points) > 0.8
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_replica_can_tokenize_and_decode(tokenizer_path: Path, tmp_path: Path) -> None:
    raw = tokenizers.Tokenizer.from_file(str(tokenizer_path))

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/detokenize":
            return httpx.Response(200, json={"prompt": raw.decode(body["tokens"])})
        text = body.get("prompt") or body["messages"][0]["content"]
        return httpx.Response(200, json={"tokens": raw.encode(text).ids})

    rows = [{"model": "m", "prompt": p} for p in samples.several_systems_texts(40)]
    log = write_log(tmp_path / "log.jsonl", rows)
    settings = AnalyzeSettings(TokenizerOptions(url="http://replica:8000"))

    async def go() -> AnalysisReport:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await analyze_log(log, settings, client)

    report = asyncio.run(go())
    assert report.num_requests == 40 and report.cached_fraction_ceiling > 0.5
    starts = {r["prompt"][:30] for r in rows}
    assert len(report.top_prefixes) == 4
    assert all(p.start[:30] in starts and p.share == 0.25 for p in report.top_prefixes)


def test_a_long_analysis_prints_progress_lines_with_an_eta(
    tokenizer_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_log(tmp_path / "log.jsonl.gz", samples.timestamped_rules(100), gz=True)
    analyze(tokenizer_path, log, tokenize_batch=1, progress_every_s=1e-9)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 2
    assert re.fullmatch(
        r"analyze: \d+/100 lines \(\d+%\) · \d+:\d\d elapsed · ETA \d+:\d\d", lines[0]
    ), lines[0]
    assert lines[-1].startswith("analyze: 100/100 lines (100%)")


def test_lines_are_counted_in_plain_and_gzip_logs(tmp_path: Path) -> None:
    rows = samples.timestamped_rules(3)
    assert count_lines(write_log(tmp_path / "a.jsonl", rows)) == 3
    assert count_lines(write_log(tmp_path / "a.jsonl.gz", rows, gz=True)) == 3
    (tmp_path / "b.jsonl").write_text("{}\n{}")  # no newline at the end
    assert count_lines(tmp_path / "b.jsonl") == 2
