"""Pure renderers of the operator views: the API's answers in, rich renderables out."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from rich.table import Table
from rich.text import Text

from kvindex.api.schemas import (
    FreshnessView,
    HealthView,
    LoadView,
    PredictionsView,
    ReplicaView,
    ScoreEntry,
    ScoreResponse,
    StreamView,
)
from kvindex.clients.console import column, make_table
from kvindex.clients.proxy.receipt import Receipt

TIERS = ("gpu", "cpu", "other")
MISS = "miss"
_CELL_STYLE = {"gpu": "green", "cpu": "yellow", "other": "blue", MISS: "dim"}
_FULL, _PARTIAL, _EMPTY = "█", "▌", "·"


@dataclass(frozen=True, slots=True)
class Strip:
    """One replica's cells: each a tier name or ``"miss"``, and whether all its blocks match."""

    kinds: tuple[str, ...]
    full: tuple[bool, ...]
    blocks_per_cell: int

    def text(self) -> Text:
        out = Text(no_wrap=True)
        for kind, full in zip(self.kinds, self.full, strict=True):
            glyph = _EMPTY if kind == MISS else (_FULL if full else _PARTIAL)
            out.append(glyph, style=_CELL_STYLE[kind])
        return out


def block_kinds(num_blocks: int, matched: int, tiers: dict[str, int]) -> list[str]:
    """Per-block kinds: the matched prefix split by tier counts (GPU, CPU, other), then misses."""
    matched = max(0, min(matched, num_blocks))
    kinds: list[str] = []
    for tier in TIERS:
        kinds += [tier] * tiers.get(tier, 0)
    kinds = kinds[:matched]
    kinds += ["other"] * (matched - len(kinds))  # counts short of the match: unknown tier
    return kinds + [MISS] * (num_blocks - matched)


def residency_strip(num_blocks: int, matched: int, tiers: dict[str, int], width: int) -> Strip:
    """A prompt's blocks in at most ``width`` cells; a cell takes its most common matched tier
    (ties: the faster) and is partial unless all its blocks match."""
    per_cell = max(1, math.ceil(num_blocks / max(1, width)))
    blocks = block_kinds(num_blocks, matched, tiers)
    kinds: list[str] = []
    full: list[bool] = []
    for start in range(0, num_blocks, per_cell):
        cell = blocks[start : start + per_cell]
        hits = Counter(kind for kind in cell if kind != MISS)
        kinds.append(min(hits, key=lambda t: (-hits[t], TIERS.index(t))) if hits else MISS)
        full.append(sum(hits.values()) == len(cell))
    return Strip(tuple(kinds), tuple(full), per_cell)


# --- small formatters ---------------------------------------------------------------------


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def _number(value: float) -> str:
    return f"{value + 0.0:.4g}"  # + 0.0: no "-0"


def format_freshness(fresh: FreshnessView) -> str:
    text = fresh.state if fresh.lag_s is None else f"{fresh.state} lag {_seconds(fresh.lag_s)}"
    return text + format_partial(fresh)


def format_partial(fresh: FreshnessView) -> str:
    """`` (partial: <reason> for 12s)``, or nothing while the view is whole."""
    if fresh.partial is None:
        return ""
    since = fresh.partial_since
    age = "" if since is None else f" for {max(0.0, time.time() - since):.0f}s"
    return f" (partial: {fresh.partial}{age})"


def format_load(load: LoadView | None) -> str:
    if load is None:
        return "-"
    routed = f" +{load.routed} routed" if load.routed else ""
    return f"{_load_numbers(load)} ({load.age_s:.1f}s old, {load.source}){routed}"


def format_load_short(load: LoadView | None) -> str:
    if load is None:
        return "-"
    return _load_numbers(load) + (f" +{load.routed} routed" if load.routed else "")


def _load_numbers(load: LoadView) -> str:
    return f"run {load.running:g} wait {load.waiting:g} kv {load.kv_usage:.0%}"


def format_health(health: HealthView | None) -> str:
    if health is None:
        return "-"
    if health.state == "healthy" and health.breaker == "half-open":
        return "healthy (breaker half-open)"
    return health.detail


_MISSES = (("over_predicted", "over"), ("under_predicted", "under"), ("token_mismatch", "tokens"))


def format_predictions(predictions: PredictionsView | None) -> str:
    """``99.9% exact of 1000``, then each kind of miss seen (``over 2``) and the unreported."""
    if predictions is None:
        return "-"
    misses = [(short, getattr(predictions, outcome)) for outcome, short in _MISSES]
    compared = predictions.exact + sum(n for _, n in misses)
    parts = [
        "none compared"
        if predictions.accuracy is None
        else f"{predictions.accuracy:.1%} exact of {compared}"
    ]
    parts += [f"{short} {n}" for short, n in misses if n]
    if predictions.unreported:
        parts.append(f"unreported {predictions.unreported}")
    verdict = predictions.verdict
    if verdict is not None and verdict.distrusted:
        parts.append(f"DISTRUSTED (cache term discounted, {verdict.num_verdicts} verdicts)")
    return ", ".join(parts)


def format_tiers(tiers: dict[str, int]) -> str:
    return "/".join(str(tiers.get(tier, 0)) for tier in TIERS)


def _marked(entry: ScoreEntry, best: str | None) -> Text:
    if entry.replica == best:
        return Text(f"★ {entry.replica}", style="bold")
    return Text(f"  {entry.replica}")


def heading(answer: ScoreResponse) -> Text:
    # Printed apart from the table, so that it wraps at the console's width, not the table's.
    title = (
        f"{answer.model} · {answer.num_tokens} tokens · {answer.num_blocks} blocks of"
        f" {answer.block_size} · policy {answer.policy}"
        + (f" (rule {answer.rule})" if answer.rule is not None else "")
        + f" · best {answer.best or 'none'}"
    )
    if len(answer.scores) < answer.num_candidates:
        title += (
            f" · top {len(answer.scores)} of {answer.num_candidates} candidates"
            f" ({answer.num_matched} matched; --top-k 0 for all)"
        )
    if answer.unhealthy and answer.degraded is None:  # degraded: the reason names them
        left_out = ", ".join(f"{r} ({why})" for r, why in sorted(answer.unhealthy.items()))
        title += f" · left out, unhealthy: {left_out}"
    tie = tie_note(answer)
    if tie is not None:
        title += f" · {tie}"
    return Text(title if answer.degraded is None else f"{title} · DEGRADED: {answer.degraded}")


def tie_note(answer: ScoreResponse) -> str | None:
    """Why the best replica won a tie on score, as the API breaks ties: the lower load, then
    chance (a softmax draw with a temperature); None when it tied with no other."""
    best = next((e for e in answer.scores if e.replica == answer.best), None)
    tied = [e for e in answer.scores if best is not None and e.score == best.score]
    if best is None or len(tied) < 2:
        return None
    head = f"tie at score {_number(best.score)} ({', '.join(e.replica for e in tied)}): "
    temperature = answer.weights.get("temperature", 0.0)
    if temperature > 0:
        return head + f"{best.replica} drawn by softmax (temperature {_number(temperature)})"
    if any("load" not in e.terms for e in tied):  # the policy shows no load term
        return head + f"{best.replica} won on lower load, then chance"
    level = [e.replica for e in tied if e.terms["load"] == best.terms["load"]]
    if len(level) == 1:
        return head + f"{best.replica} has the lowest load"
    which = "" if len(level) == len(tied) else f" ({', '.join(level)})"
    return head + f"same load{which}: {best.replica} drawn by chance"


# --- renderers -----------------------------------------------------------------------------


def render_residency(answer: ScoreResponse, width: int, wide: bool = False) -> list[Any]:
    """The heading, the residency table (``wide``: with loads) and the strip's legend."""
    columns = [
        column("replica"),
        column("blocks"),
        column("matched"),
        column("tokens"),
        column("gpu/cpu/other"),
        column("fresh"),
    ]
    table = make_table(*columns, *([column("load")] if wide else []))
    per_cell = 1
    for entry in answer.scores:
        strip = residency_strip(answer.num_blocks, entry.matched_blocks, entry.tiers, width)
        per_cell = strip.blocks_per_cell
        table.add_row(
            _marked(entry, answer.best),
            strip.text(),
            f"{entry.matched_blocks}/{answer.num_blocks}",
            f"{entry.matched_tokens}/{answer.num_tokens}",
            format_tiers(entry.tiers),
            format_freshness(entry.freshness),
            *([format_load(entry.load)] if wide else []),
        )
    return [heading(answer), table, _legend(per_cell, answer.num_blocks)]


def _legend(per_cell: int, num_blocks: int) -> Text:
    legend = Text(f"1 cell = {per_cell} block{'s' if per_cell > 1 else ''}: ")
    if num_blocks == 0:
        legend = Text("the prompt is shorter than one block: nothing can match. ")
    for tier in TIERS:
        legend.append(_FULL, style=_CELL_STYLE[tier]).append(f" {tier}  ")
    legend.append(f"{_PARTIAL} partly matched  {_EMPTY} miss")
    legend.append(
        "\nthe API counts matched blocks per tier, not their positions: the matched prefix"
        " is drawn GPU, then CPU, then other, in proportion; ★ marks the best replica."
    )
    return legend


def render_score(answer: ScoreResponse, wide: bool = False) -> list[Any]:
    """The heading and the ranked candidates, one row each; ``wide``: also the rank, the
    tiers, the load's age and source, and each term of the policy's formula."""
    terms = sorted({name for entry in answer.scores for name in entry.terms}) if wide else []
    fixed = ["replica", *(["rank", "gpu/cpu/other"] if wide else []), "matched", "fresh", "load"]
    table = make_table(
        *(column(name, justify="right" if name == "rank" else "left") for name in fixed),
        *(column(f"{name} term" if name in fixed else name, justify="right") for name in terms),
        column("score", justify="right"),
    )
    for entry in answer.scores:
        extra = [str(entry.rank), format_tiers(entry.tiers)] if wide else []
        table.add_row(
            _marked(entry, answer.best),
            *extra,
            f"{entry.matched_blocks} blk / {entry.matched_tokens} tok",
            format_freshness(entry.freshness),
            format_load(entry.load) if wide else format_load_short(entry.load),
            *(_number(entry.terms[name]) if name in entry.terms else "-" for name in terms),
            _number(entry.score),
        )
    return [heading(answer), table]


def _streams_cell(view: ReplicaView, wide: bool) -> str:
    return "\n".join(_stream_line(s, wide) for s in view.streams) or "(no events yet)"


def _stream_line(stream: StreamView, wide: bool) -> str:
    line = f"{stream.rank}: seq {stream.last_seq}, {format_tiers(stream.blocks)}"
    line += f", lag {_seconds(stream.freshness.lag_s)}{format_partial(stream.freshness)}"
    if stream.block_size_mismatch:
        line += f", block size {stream.block_size} (not the model's: never matches)"
    elif wide and stream.block_size:
        line += f", block size {stream.block_size}"
    if stream.owner is not None:
        line += f", indexer {stream.owner}"
    return line + ("" if stream.connected else ", disconnected")


def render_replicas(views: list[ReplicaView], wide: bool = False) -> list[Any]:
    """One table per model, one row per replica, one line per data-parallel stream; then the
    legend. ``wide``: also the data-parallel size, the endpoints, the load's age and source."""
    by_model: dict[str, list[ReplicaView]] = {}
    for view in views:
        by_model.setdefault(view.model, []).append(view)
    if not by_model:
        return [Text("no replicas registered")]
    tables = [_model_table(model, group, wide) for model, group in by_model.items()]
    return [*tables, Text(f"streams: rank: seq, blocks {'/'.join(TIERS)}, lag of the last batch")]


def _model_table(model: str, views: list[ReplicaView], wide: bool) -> Table:
    ends = ("dp", "url", "events", "replay") if wide else ()
    judged = ("predictions",) if any(v.predictions is not None for v in views) else ()
    table = make_table(
        *(column(name) for name in ("id", "state", "health", "streams", "load", *judged, *ends)),
        title=f"{model} · {len(views)} replica{'s' if len(views) > 1 else ''}",
    )
    for view in views:
        endpoints = [str(view.dp_size), *(v or "-" for v in (view.url, view.events, view.replay))]
        table.add_row(
            view.id,
            view.state,
            format_health(view.health),
            _streams_cell(view, wide),
            format_load(view.load) if wide else format_load_short(view.load),
            *([format_predictions(view.predictions)] if judged else []),
            *(endpoints if wide else []),
        )
    return table


def render_stats(stats: dict[str, Any]) -> Table:
    table = make_table(column("total"), column("value", justify="right"), title="kvindex stats")
    for name, value in stats.items():
        shown = (
            " · ".join(f"{k} {v}" for k, v in value.items())
            if isinstance(value, dict)
            else str(value)
        )
        table.add_row(name, shown)
    return table


# --- a route's receipt (kvindex why) ---------------------------------------------------------

_OUTCOME_WORDS = {
    "exact": "the index was right",
    "over_predicted": "the index credited {error} tokens the engine did not have cached"
    " (a stale index, lost removals, hash drift)",
    "under_predicted": "the engine had {missed} more tokens cached than the index knew"
    " (lost stores, event lag, a partial stream)",
    "token_mismatch": "the engine counted {prompt} prompt tokens, the router {num_tokens}"
    " (tokenizer or chat-template drift): the blocks cannot be compared",
    "unreported": "the engine reported no cached tokens (vLLM: --enable-prompt-tokens-details)",
}


def render_receipt(receipt: Receipt) -> list[Any]:
    """A route in words: the request, the choice and what came of it, the candidates with
    each term of the policy's formula, and the prediction against the engine's answer."""
    return [_receipt_heading(receipt), _candidates_table(receipt), _prediction_text(receipt)]


def _receipt_heading(r: Receipt) -> Text:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(r.time))
    title = (
        f"request {r.id} · {r.route} · {r.model} · {r.num_tokens} tokens · {r.num_blocks}"
        f" blocks of {r.block_size} · policy {r.policy}"
        + (f" (rule {r.rule})" if r.rule is not None else "")
        + f" · {when}"
    )
    chose = f"chose {r.chosen or 'none'} of {r.num_candidates} candidates"
    if r.fallbacks:
        chose += f" (then {', '.join(r.fallbacks)})"
    if r.answered_by is None:
        chose += f"; no replica answered · status {r.status}"
    else:
        retried = f" after {r.retries} retr{'y' if r.retries == 1 else 'ies'}" if r.retries else ""
        chose += f"; answered by {r.answered_by}{retried} · status {r.status}"
        chose += f" · first byte {r.ttfb_ms:.1f} ms" if r.ttfb_ms is not None else ""
    chose += f" · {r.duration_ms:.1f} ms in all"
    lines = [title, chose]
    if r.untokenized:
        lines.append("the prompt's tokenizer failed: ranked on load alone")
    if r.head:
        lines.append("chosen on the prompt's head: no replica held its start")
    if r.unhealthy:
        lines.append(
            "left out, unhealthy: " + ", ".join(f"{k} ({v})" for k, v in r.unhealthy.items())
        )
    if r.degraded is not None:
        lines.append(f"DEGRADED: {r.degraded}")
    return Text("\n".join(lines))


def _candidates_table(r: Receipt) -> Table:
    terms = list(dict.fromkeys(name for entry in r.candidates for name in entry.terms))
    table = make_table(
        *(column(name) for name in ("replica", "matched", "fresh", "load")),
        *(column(f"{name}", justify="right") for name in terms),
        column("score", justify="right"),
        title=f"top {len(r.candidates)} of {r.num_candidates} candidates, best first",
    )
    for entry in r.candidates:
        table.add_row(
            _marked(entry, r.chosen),
            f"{entry.matched_blocks} blk / {entry.matched_tokens} tok",
            format_freshness(entry.freshness),
            format_load_short(entry.load),
            *(_number(entry.terms[name]) if name in entry.terms else "-" for name in terms),
            _number(entry.score),
        )
    return table


def _prediction_text(r: Receipt) -> Text:
    if r.predicted_tokens is None:
        return Text("prediction: none (no replica answered, or the prompt was not tokenized)")
    head = f"prediction: the index matched {r.predicted_tokens} tokens on {r.answered_by}"
    if r.outcome is None:
        return Text(f"{head}; not compared (the answer was not a whole 200)")
    if r.cached_tokens is not None:
        head += f"; the engine reported {r.cached_tokens} of {r.prompt_tokens} cached"
    words = _OUTCOME_WORDS[r.outcome].format(
        error=r.error_tokens,
        missed=-(r.error_tokens or 0),
        prompt=r.prompt_tokens,
        num_tokens=r.num_tokens,
    )
    return Text(f"{head}\noutcome: {r.outcome}: {words}")
