"""Pure helpers of clients/views.py: strips, formatters, renderers, prompt files."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import click
import pytest
from rich.console import Console

from kvindex.api.schemas import (
    FreshnessView,
    LoadView,
    ReplicaView,
    ScoreEntry,
    ScoreResponse,
    StreamView,
)
from kvindex.clients.cli.views import (
    block_kinds,
    format_freshness,
    format_load,
    make_console,
    prompt_fields,
    read_messages,
    read_tokens,
    render_replicas,
    render_residency,
    render_score,
    render_stats,
    residency_strip,
)

LIVE = FreshnessView("live", 0.25, 1.0)


def plain(*renderables: Any) -> str:
    out = io.StringIO()
    Console(file=out, width=200, no_color=True, highlight=False).print(*renderables)
    return out.getvalue()


def entry(replica: str, matched: int, tiers: dict[str, int], score: float) -> ScoreEntry:
    return ScoreEntry(
        replica=replica,
        rank=0,
        matched_blocks=matched,
        matched_tokens=matched * 16,
        tiers=tiers,
        load=LoadView(2, 1, 0.25, 0.5, "push") if replica == "a" else None,
        freshness=LIVE,
        terms={"cache": score, "load": -0.0},
        score=score,
    )


def answer(num_blocks: int = 10) -> ScoreResponse:
    return ScoreResponse(
        model="m",
        block_size=16,
        num_tokens=num_blocks * 16,
        num_blocks=num_blocks,
        best="a",
        policy="kv_aware",
        weights={},
        scores=[
            entry("a", 6, {"gpu": 4, "cpu": 2, "other": 0}, 0.5),
            entry("b", 0, {"gpu": 0, "cpu": 0, "other": 0}, 0.0),
        ],
    )


# --- strips -----------------------------------------------------------------------------------


def test_block_kinds_split_the_prefix_by_tier() -> None:
    kinds = block_kinds(6, 4, {"gpu": 1, "cpu": 2, "other": 1})
    assert kinds == ["gpu", "cpu", "cpu", "other", "miss", "miss"]
    assert block_kinds(3, 5, {"gpu": 5}) == ["gpu"] * 3  # clamped to the prompt
    assert block_kinds(3, 2, {}) == ["other", "other", "miss"]  # counts missing: unknown tier


def test_strip_one_cell_per_block() -> None:
    strip = residency_strip(5, 3, {"gpu": 2, "cpu": 1}, width=64)
    assert strip.blocks_per_cell == 1
    assert strip.kinds == ("gpu", "gpu", "cpu", "miss", "miss")
    assert strip.text().plain == "███··"


def test_strip_groups_long_prompts() -> None:
    strip = residency_strip(100, 25, {"gpu": 5, "cpu": 20}, width=10)
    assert strip.blocks_per_cell == 10 and len(strip.kinds) == 10
    # cells: blocks 0-9 (5 gpu, 5 cpu: tie → gpu), 10-19 cpu, 20-29 half matched, misses
    assert strip.kinds[:4] == ("gpu", "cpu", "cpu", "miss")
    assert strip.full[:3] == (True, True, False)
    assert strip.text().plain == "██▌" + "·" * 7


def test_strip_styles_and_empty_prompt() -> None:
    spans = residency_strip(3, 2, {"gpu": 1, "cpu": 1}).text().spans
    assert [str(span.style) for span in spans] == ["green", "yellow", "dim"]
    empty = residency_strip(0, 0, {})
    assert (empty.kinds, empty.text().plain) == ((), "")


# --- formatters and renderers ---------------------------------------------------------------


def test_formatters() -> None:
    assert format_freshness(LIVE) == "live lag 0.25s"
    assert format_freshness(FreshnessView("stale", None, None)) == "stale"
    assert format_load(None) == "-"
    assert format_load(LoadView(3, 1, 0.5, 1.25, "push")) == "run 3 wait 1 kv 50% (1.2s old, push)"
    routed = LoadView(3, 1, 0.5, 1.25, "scrape", routed=2)
    assert format_load(routed) == "run 3 wait 1 kv 50% (1.2s old, scrape) +2 routed"


def test_render_residency() -> None:
    text = plain(*render_residency(answer(), width=5))
    assert "1 cell = 2 blocks" in text
    row_a = next(line for line in text.splitlines() if "│" in line and " a " in line)
    assert "★ a" in row_a and "███··" in row_a and "6/10" in row_a and "4/2/0" in row_a
    assert "run 2 wait 1 kv 25%" in row_a
    assert "·····" in next(line for line in text.splitlines() if "│" in line and " b " in line)
    assert "best a" in text
    short = plain(*render_residency(answer(num_blocks=0)))
    assert "shorter than one block" in short


def test_render_score_has_every_term() -> None:
    text = plain(render_score(answer()))
    header = next(line for line in text.splitlines() if "replica" in line)
    assert all(name in header for name in ("cache", "load", "score"))
    assert "-0 " not in text  # negative zero is shown as 0
    degraded = answer()
    degraded.degraded = "index store unavailable"
    assert "DEGRADED: index store unavailable" in plain(render_score(degraded))


def test_render_replicas_and_stats() -> None:
    stream = StreamView(0, LIVE, False, 42, {"gpu": 7, "cpu": 1, "other": 0}, {})
    views = [
        ReplicaView("r1", "m", None, None, None, 1, "live", [stream], None),
        ReplicaView("r2", "m", None, None, None, 1, "stale", [], None),
    ]
    text = plain(render_replicas(views))
    assert "0: seq 42, 7/1/0, lag 0.25s, disconnected" in text
    assert "(no events yet)" in text
    stats = plain(render_stats({"replicas": 2, "blocks": {"gpu": 9, "cpu": 0}}))
    assert "gpu 9 · cpu 0" in stats


def test_console_has_no_colour_off_a_tty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    console = make_console()  # pytest captures stdout: not a TTY
    assert (console.is_terminal, console.no_color) == (False, True)


# --- prompt files -----------------------------------------------------------------------------


def test_read_tokens_both_forms(tmp_path: Path) -> None:
    as_json = tmp_path / "a.json"
    as_json.write_text("[1, 2, 3]")
    spaced = tmp_path / "a.txt"
    spaced.write_text("1 2\n3\n")
    assert read_tokens(as_json) == read_tokens(spaced) == [1, 2, 3]
    for bad_text in ("[1.5]", "[true]", "1 x", '{"a": 1}'):
        bad = tmp_path / "bad"
        bad.write_text(bad_text)
        with pytest.raises(click.BadParameter):
            read_tokens(bad)


def test_read_messages(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text('[{"role": "user", "content": "hi"}]')
    assert read_messages(path) == [{"role": "user", "content": "hi"}]
    path.write_text('{"role": "user"}')
    with pytest.raises(click.BadParameter, match="list"):
        read_messages(path)


def test_prompt_fields_needs_exactly_one(tmp_path: Path) -> None:
    assert prompt_fields("hi", None, None) == {"prompt": "hi"}
    with pytest.raises(click.UsageError, match="exactly one"):
        prompt_fields(None, None, None)
    with pytest.raises(click.UsageError, match="exactly one"):
        prompt_fields("hi", tmp_path, None)
