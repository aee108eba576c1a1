"""The pure renderers of the views (clients/cli/render.py): strips, formatters, tables."""

from __future__ import annotations

import io
import re
import time
from typing import Any

from msgspec.structs import replace
from rich.console import Console

from kvindex.api.schemas import (
    FreshnessView,
    HealthView,
    LoadView,
    PredictionsView,
    ReplicaView,
    ScoreEntry,
    ScoreResponse,
    StreamView,
    VerdictView,
)
from kvindex.clients.cli.render import (
    block_kinds,
    format_freshness,
    format_health,
    format_load,
    format_load_short,
    heading,
    render_replicas,
    render_residency,
    render_score,
    render_stats,
    residency_strip,
)
from kvindex.clients.console import make_console

LIVE = FreshnessView("live", 0.25, 1.0)


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def plain(*renderables: Any) -> str:
    """``renderables`` as the CLI prints them into a pipe."""
    out = io.StringIO()
    make_console(out).print(*renderables)
    return out.getvalue()


def on_terminal(columns: int, *renderables: Any) -> list[str]:
    """The lines a terminal ``columns`` wide shows of ``renderables``, styles stripped."""
    out = io.StringIO()
    Console(file=out, width=columns, force_terminal=True, highlight=False).print(*renderables)
    return ANSI.sub("", out.getvalue()).splitlines()


def row(text: str, replica: str) -> str:
    """The line of ``replica`` in a score or residency table (``★`` marks the best)."""
    return next(line for line in text.splitlines() if line[2:].startswith(f"{replica} "))


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
        num_candidates=2,
        num_matched=1,
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
    spans = residency_strip(3, 2, {"gpu": 1, "cpu": 1}, 64).text().spans
    assert [str(span.style) for span in spans] == ["green", "yellow", "dim"]
    empty = residency_strip(0, 0, {}, 64)
    assert (empty.kinds, empty.text().plain) == ((), "")


# --- formatters and renderers ---------------------------------------------------------------


def test_formatters() -> None:
    assert format_freshness(LIVE) == "live lag 0.25s"
    assert format_freshness(FreshnessView("stale", None, None)) == "stale"
    partial = FreshnessView("partial", 0.25, 1.0, "replay_gap_past_buffer", time.time() - 90)
    shown = "partial lag 0.25s (partial: replay_gap_past_buffer for 90s)"
    assert format_freshness(partial) == shown
    assert format_load(None) == "-"
    assert format_load(LoadView(3, 1, 0.5, 1.25, "push")) == "run 3 wait 1 kv 50% (1.2s old, push)"
    routed = LoadView(3, 1, 0.5, 1.25, "scrape", routed=2)
    assert format_load(routed) == "run 3 wait 1 kv 50% (1.2s old, scrape) +2 routed"
    assert format_load_short(routed) == "run 3 wait 1 kv 50% +2 routed"
    assert format_load_short(None) == "-"


def test_render_residency() -> None:
    text = plain(*render_residency(answer(), width=5))
    assert "1 cell = 2 blocks" in text
    row_a = row(text, "a")
    assert row_a.startswith("★ a") and "███··" in row_a and "6/10" in row_a and "4/2/0" in row_a
    assert "run 2 wait" not in text  # the load is --wide's
    assert "·····" in row(text, "b")
    assert "best a" in text.splitlines()[0]  # the heading, above the table
    wide = plain(*render_residency(answer(), width=5, wide=True))
    assert "run 2 wait 1 kv 25% (0.5s old, push)" in row(wide, "a")
    short = plain(*render_residency(answer(num_blocks=0), 64))
    assert "shorter than one block" in short


def test_render_score_shows_the_key_columns() -> None:
    text = plain(*render_score(answer()))
    header = text.splitlines()[1]
    assert header.split() == ["replica", "matched", "fresh", "load", "score"]
    row_a = row(text, "a")
    assert "6 blk / 96 tok" in row_a and "live lag 0.25s" in row_a
    assert "run 2 wait 1 kv 25%" in row_a and "old" not in row_a and row_a.endswith("0.5")
    assert "-0 " not in text  # negative zero is shown as 0
    degraded = answer()
    degraded.degraded = "index store unavailable"
    assert "DEGRADED: index store unavailable" in plain(*render_score(degraded))


def test_the_heading_says_how_many_candidates_the_answer_leaves_out() -> None:
    assert "candidates" not in plain(*render_score(answer()))  # every one shown
    fleet = answer()
    fleet.num_candidates, fleet.num_matched = 1_024, 256
    heading_line = plain(*render_score(fleet)).splitlines()[0]
    assert heading_line.endswith("top 2 of 1024 candidates (256 matched; --top-k 0 for all)")


def test_the_heading_names_the_routing_rule_that_chose_the_policy() -> None:
    assert "rule" not in plain(*render_score(answer())).splitlines()[0]
    ruled = answer()
    ruled.rule = "batch"
    assert f"policy {ruled.policy} (rule batch) · best" in plain(*render_score(ruled))


def test_render_score_wide_has_every_term_under_a_name_of_its_own() -> None:
    _, table = render_score(answer(), wide=True)
    names = [str(col.header) for col in table.columns]
    columns = ["replica", "rank", "gpu/cpu/other", "matched", "fresh", "load"]
    assert names == [*columns, "cache", "load term", "score"]  # every term, sorted, then score
    assert "(0.5s old, push)" in row(plain(*render_score(answer(), wide=True)), "a")


def tied(loads: list[float], weights: dict[str, float] | None = None) -> ScoreResponse:
    """Three replicas holding the whole prompt (score 1), ``a`` picked; their load terms."""
    entries = [
        replace(entry(name, 10, {"gpu": 10}, 1.0), terms={"cache": 1.0, "load": -load})
        for name, load in zip("abc", loads, strict=True)
    ]
    return replace(answer(), scores=entries, weights=weights or {}, num_candidates=3)


def test_the_heading_says_why_the_best_won_a_tie() -> None:
    assert "tie at score 1 (a, b, c): a has the lowest load" in plain(heading(tied([0, 1, 2])))
    drawn = plain(heading(tied([0.5, 0.5, 2])))
    assert "tie at score 1 (a, b, c): same load (a, b): a drawn by chance" in drawn
    hot = plain(heading(tied([0, 0, 0], {"temperature": 0.5})))
    assert "a drawn by softmax (temperature 0.5)" in hot
    assert "tie" not in plain(heading(answer()))  # a won alone


def test_score_at_100_columns_is_one_line_per_candidate() -> None:
    """Long model and replica names, a routed count: still one line each, nothing cut."""
    busy = LoadView(12, 30, 0.97, 1.25, "scrape", routed=12)
    fleet = answer()
    fleet.model = "meta-llama/Llama-3.1-70B-Instruct"
    fleet.scores = [
        entry(f"vllm-replica-{i:02d}", 6 - i, {"gpu": 6 - i}, 0.123456 * i) for i in range(6)
    ]
    for candidate in fleet.scores:
        candidate.load = busy
        candidate.freshness = FreshnessView("replaying", 12.5, 3.0)
    fleet.best = fleet.scores[0].replica
    lines = on_terminal(100, *render_score(fleet))
    assert max(len(line) for line in lines) <= 100 and "…" not in "".join(lines)
    body = lines[next(i for i, line in enumerate(lines) if set(line) == {"─"}) + 1 :]
    assert len(body) == len(fleet.scores)
    for line, candidate in zip(body, fleet.scores, strict=True):
        assert line[2:].startswith(candidate.replica)
        assert "run 12 wait 30 kv 97% +12 routed" in line and "replaying lag 12.50s" in line


def test_render_replicas_one_table_per_model() -> None:
    stream = StreamView(0, LIVE, False, 42, {"gpu": 7, "cpu": 1, "other": 0}, {})
    views = [
        ReplicaView("r1", "m", "tcp://h:5557", None, "http://h:8000", 1, "live", [stream], None),
        ReplicaView("r2", "m", None, None, None, 1, "stale", [], None),
        ReplicaView("r3", "other/model", None, None, None, 1, "live", [], None),
    ]
    text = plain(*render_replicas(views))
    lines = text.splitlines()
    assert "m · 2 replicas" in lines and "other/model · 1 replica" in lines
    r1 = next(line for line in lines if line.startswith("r1 "))
    assert "0: seq 42, 7/1/0, lag 0.25s, disconnected" in r1
    assert "(no events yet)" in next(line for line in lines if line.startswith("r2 "))
    assert "http://h:8000" not in text
    wide = plain(*render_replicas(views, wide=True))
    assert "http://h:8000" in wide and "tcp://h:5557" in wide
    assert plain(*render_replicas([])).strip() == "no replicas registered"


def test_render_replicas_shows_a_block_size_that_is_not_the_models() -> None:
    right = StreamView(0, LIVE, True, 3, {"gpu": 1}, {}, block_size=16)
    wrong = StreamView(0, LIVE, True, 3, {"gpu": 1}, {}, block_size=32, block_size_mismatch=True)
    views = [
        ReplicaView("r1", "m", None, None, None, 1, "live", [right], None),
        ReplicaView("r2", "m", None, None, None, 1, "live", [wrong], None),
    ]
    lines = plain(*render_replicas(views)).splitlines()
    r1 = next(line for line in lines if line.startswith("r1 "))
    r2 = next(line for line in lines if line.startswith("r2 "))
    assert "block size" not in r1
    assert "block size 32 (not the model's: never matches)" in r2
    assert "block size 16" in plain(*render_replicas(views, wide=True))


def test_render_replicas_shows_a_proxys_predictions() -> None:
    """Only a proxy's views carry predictions: the column appears with them."""
    judged = PredictionsView(
        0.9, exact=9, over_predicted=1, unreported=2, verdict=VerdictView(True, 2)
    )
    views = [
        ReplicaView("r1", "m", None, None, None, 1, "live", [], None, predictions=judged),
        ReplicaView(
            "r2", "m", None, None, None, 1, "live", [], None, predictions=PredictionsView(None)
        ),
    ]
    lines = plain(*render_replicas(views)).splitlines()
    assert "predictions" in lines[1]
    assert "90.0% exact of 10, over 1, unreported 2, DISTRUSTED (cache term discounted, 2" in (
        row_of(lines, "r1")
    )
    assert "none compared" in row_of(lines, "r2")
    plain_views = [ReplicaView("r1", "m", None, None, None, 1, "live", [], None)]
    assert "predictions" not in plain(*render_replicas(plain_views))


def test_render_stats() -> None:
    stats = plain(render_stats({"replicas": 2, "blocks": {"gpu": 9, "cpu": 0}}))
    assert "gpu 9 · cpu 0" in stats


# --- prompt files -----------------------------------------------------------------------------


def _health(state: str, detail: str, breaker: str = "closed") -> HealthView:
    return HealthView(state, detail, 3, 0, 0.5, breaker, "ConnectError: refused", 1)


def test_render_replicas_shows_health() -> None:
    ejected = _health("ejected", "ejected: 3 failed health checks (ConnectError: refused)")
    views = [
        ReplicaView("r1", "m", None, None, None, 1, "stale", [], None, ejected),
        ReplicaView("r2", "m", None, None, None, 1, "live", [], None, _health("healthy", "x")),
        ReplicaView("r3", "m", None, None, None, 1, "live", [], None),
    ]
    lines = plain(*render_replicas(views)).splitlines()
    assert lines[1].split()[:3] == ["id", "state", "health"]
    assert "ejected: 3 failed health checks (ConnectError: refused)" in row_of(lines, "r1")
    assert "x" in row_of(lines, "r2").split()
    assert row_of(lines, "r3").split()[2] == "-"
    half = _health("healthy", "healthy", breaker="half-open")
    assert format_health(half) == "healthy (breaker half-open)"


def row_of(lines: list[str], replica: str) -> str:
    return next(line for line in lines if line.startswith(f"{replica} "))


def test_the_heading_names_the_unhealthy_candidates_left_out() -> None:
    fleet = answer()
    fleet.unhealthy = {"dead": "events stream never connected"}
    heading_line = plain(*render_score(fleet)).splitlines()[0]
    assert heading_line.endswith("left out, unhealthy: dead (events stream never connected)")
    fleet.degraded = "no healthy candidate, every one ranked (dead: ...)"
    heading_line = plain(*render_residency(fleet, 64)).splitlines()[0]
    assert "left out" not in heading_line and "DEGRADED: no healthy candidate" in heading_line


def test_render_replicas_names_the_indexer_that_keeps_a_sharded_stream() -> None:
    kept = StreamView(0, LIVE, True, 3, {"gpu": 1}, {}, owner="idx-a")
    alone = StreamView(0, LIVE, True, 3, {"gpu": 1}, {})
    views = [
        ReplicaView("r1", "m", None, None, None, 1, "live", [kept], None),
        ReplicaView("r2", "m", None, None, None, 1, "live", [alone], None),
    ]
    lines = plain(*render_replicas(views)).splitlines()
    assert "indexer idx-a" in next(line for line in lines if line.startswith("r1 "))
    assert "indexer" not in next(line for line in lines if line.startswith("r2 "))
