"""Operator views of a running kvindex API: ``residency``, ``score``, ``replicas``, ``stats``.

Each command is a thin shell over :class:`kvindex.clients.http.KvIndexClient` (never the index
itself): call the API, then render the answer with rich, or print it as JSON (``--json``:
the API's own body, re-encoded, stable for scripts). The rendering helpers are pure
functions of the API's types, so they are tested without a server.

Tables are printed on the one console of :mod:`kvindex.clients.console`: fitted to a
terminal (``score``: one line per candidate at 100 columns; ``--wide`` for every column),
whole rows with whole values when piped, colour only on a terminal without ``NO_COLOR``.
Every client failure becomes a one-line :class:`click.ClickException` (exit 1)
carrying the server's error kind and detail, or saying the server could not be reached.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvindex.api.schemas import (
    FreshnessView,
    HealthView,
    LoadView,
    ReplicaView,
    ScoreEntry,
    ScoreResponse,
    StreamView,
)
from kvindex.clients.console import column, make_console, make_table, natural_width
from kvindex.clients.http import KvIndexClient, KvIndexClientError, UnreachableError

__all__ = [
    "Strip",
    "fit_strip",
    "register_views",
    "render_replicas",
    "render_residency",
    "render_score",
    "render_stats",
    "residency_strip",
]

DEFAULT_URL = "http://127.0.0.1:8000"
STRIP_WIDTH = 64
"""Most cells of a residency strip; longer prompts group several blocks per cell."""
MIN_STRIP = 8
"""Fewest cells of a residency strip, however narrow the terminal."""
TIERS = ("gpu", "cpu", "other")
MISS = "miss"
_CELL_STYLE = {"gpu": "green", "cpu": "yellow", "other": "blue", MISS: "dim"}
_FULL, _PARTIAL, _EMPTY = "█", "▌", "·"


# --- the residency strip (pure) ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Strip:
    """One replica's row of cells: ``kinds[i]`` is a tier name or ``"miss"``, ``full[i]``
    whether every block of the cell is matched (a cell is a hit when any block is)."""

    kinds: tuple[str, ...]
    full: tuple[bool, ...]
    blocks_per_cell: int

    def text(self) -> Text:
        """The strip as styled text: █ a matched cell, ▌ a partly matched one, · a miss."""
        out = Text(no_wrap=True)
        for kind, full in zip(self.kinds, self.full, strict=True):
            glyph = _EMPTY if kind == MISS else (_FULL if full else _PARTIAL)
            out.append(glyph, style=_CELL_STYLE[kind])
        return out


def block_kinds(num_blocks: int, matched: int, tiers: dict[str, int]) -> list[str]:
    """Per-block kinds of a prompt: the matched prefix split by tier in proportion to the
    counts (GPU first, then CPU, then other: the API gives counts per tier, not positions),
    then misses. ``matched`` is clamped to ``num_blocks``."""
    matched = max(0, min(matched, num_blocks))
    kinds: list[str] = []
    for tier in TIERS:
        kinds += [tier] * tiers.get(tier, 0)
    kinds = kinds[:matched]
    kinds += ["other"] * (matched - len(kinds))  # counts short of the match: unknown tier
    return kinds + [MISS] * (num_blocks - matched)


def residency_strip(
    num_blocks: int, matched: int, tiers: dict[str, int], width: int = STRIP_WIDTH
) -> Strip:
    """Group a prompt's blocks into at most ``width`` cells of ``ceil(n / width)`` blocks.

    A cell is drawn as a hit when any of its blocks is matched, coloured by the most common
    tier among its matched blocks (ties: the faster tier), and marked partial unless all of
    its blocks are matched. Zero blocks give an empty strip.
    """
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
    """``live``, with the lag when known: ``live lag 0.01s``."""
    return fresh.state if fresh.lag_s is None else f"{fresh.state} lag {_seconds(fresh.lag_s)}"


def format_load(load: LoadView | None) -> str:
    """``run 3 wait 1 kv 50% (1.2s old, push)``, ``+2 routed`` when answers chose the
    replica since; ``-`` when no load is known."""
    if load is None:
        return "-"
    routed = f" +{load.routed} routed" if load.routed else ""
    return f"{_load_numbers(load)} ({load.age_s:.1f}s old, {load.source}){routed}"


def format_load_short(load: LoadView | None) -> str:
    """:func:`format_load` without the age and source: ``run 3 wait 1 kv 50% +2 routed``."""
    if load is None:
        return "-"
    return _load_numbers(load) + (f" +{load.routed} routed" if load.routed else "")


def _load_numbers(load: LoadView) -> str:
    return f"run {load.running:g} wait {load.waiting:g} kv {load.kv_usage:.0%}"


def format_health(health: HealthView | None) -> str:
    """``healthy`` (``-`` when never judged), or why the replica is ejected; a half-open
    breaker says so."""
    if health is None:
        return "-"
    if health.state == "healthy" and health.breaker == "half-open":
        return "healthy (breaker half-open)"
    return health.detail


def format_tiers(tiers: dict[str, int]) -> str:
    """``gpu/cpu/other`` counts: ``4/0/0``."""
    return "/".join(str(tiers.get(tier, 0)) for tier in TIERS)


def _marked(entry: ScoreEntry, best: str | None) -> Text:
    if entry.replica == best:
        return Text(f"★ {entry.replica}", style="bold")
    return Text(f"  {entry.replica}")


def heading(answer: ScoreResponse) -> Text:
    """The line above a score answer's table: model, prompt size, policy (and the
    ``[[rules]]`` entry that chose it, if one did), best replica (how many candidates the
    answer leaves out, if any; the unhealthy ones left out of the ranking, and why; why it
    is degraded, if it is).
    Printed on its own, not as the table's title, so that it wraps at the console's width
    rather than the table's."""
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
    return Text(title if answer.degraded is None else f"{title} · DEGRADED: {answer.degraded}")


# --- renderers (pure: API types in, rich renderables out) ---------------------------------


def render_residency(
    answer: ScoreResponse, width: int = STRIP_WIDTH, wide: bool = False
) -> list[Any]:
    """The heading, the residency table (``wide``: with each replica's load) and the strip's
    legend."""
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


def fit_strip(console: Console, answer: ScoreResponse, wide: bool = False) -> int:
    """Cells per strip for which the residency table fits ``console``'s width: between
    :data:`MIN_STRIP` and :data:`STRIP_WIDTH` (off a terminal: the latter)."""
    spare = console.width - natural_width(console, render_residency(answer, MIN_STRIP, wide)[1])
    return max(MIN_STRIP, min(STRIP_WIDTH, MIN_STRIP + spare))


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
    """The heading and every candidate, ranked, one row each. By default the key columns
    (matched blocks and tokens, freshness, load, score: one line per candidate on a
    100-column terminal); ``wide``: also the rank, the tiers, the load's age and source and
    each term of the policy's formula."""
    terms = sorted({name for entry in answer.scores for name in entry.terms}) if wide else []
    table = make_table(
        column("replica"),
        *([column("rank", justify="right"), column("gpu/cpu/other")] if wide else []),
        column("matched"),
        column("fresh"),
        column("load"),
        *(column(name, justify="right") for name in terms),
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
    """One stream: seq, blocks, lag; its block size when wide, and always when it is not
    its model's (such a stream never matches a prompt)."""
    line = f"{stream.rank}: seq {stream.last_seq}, {format_tiers(stream.blocks)}"
    line += f", lag {_seconds(stream.freshness.lag_s)}"
    if stream.block_size_mismatch:
        line += f", block size {stream.block_size} (not the model's: never matches)"
    elif wide and stream.block_size:
        line += f", block size {stream.block_size}"
    if stream.owner is not None:
        line += f", indexer {stream.owner}"
    return line + ("" if stream.connected else ", disconnected")


def render_replicas(views: list[ReplicaView], wide: bool = False) -> list[Any]:
    """One table per model (its name in the title, so that rows need not repeat it), in
    the order the models first appear; one row per replica, one line per data-parallel
    stream in the streams cell; then the streams legend. ``wide``: also the data-parallel
    size, the endpoints and the load's age and source."""
    by_model: dict[str, list[ReplicaView]] = {}
    for view in views:
        by_model.setdefault(view.model, []).append(view)
    if not by_model:
        return [Text("no replicas registered")]
    tables = [_model_table(model, group, wide) for model, group in by_model.items()]
    return [*tables, Text(f"streams: rank: seq, blocks {'/'.join(TIERS)}, lag of the last batch")]


def _model_table(model: str, views: list[ReplicaView], wide: bool) -> Table:
    ends = ("dp", "url", "events", "replay") if wide else ()
    table = make_table(
        *(column(name) for name in ("id", "state", "health", "streams", "load", *ends)),
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
            *(endpoints if wide else []),
        )
    return table


def render_stats(stats: dict[str, Any]) -> Table:
    """``GET /stats`` as name/value rows (nested maps flattened to ``k v · k v``)."""
    table = make_table(column("total"), column("value", justify="right"), title="kvindex stats")
    for name, value in stats.items():
        shown = (
            " · ".join(f"{k} {v}" for k, v in value.items())
            if isinstance(value, dict)
            else str(value)
        )
        table.add_row(name, shown)
    return table


# --- command plumbing ---------------------------------------------------------------------


@contextmanager
def connected(url: str, token: str | None) -> Iterator[KvIndexClient]:
    """A client for ``url``; its failures leave as one-line :class:`click.ClickException`."""
    try:
        with KvIndexClient(url, token=token) as client:
            yield client
    except UnreachableError as exc:
        raise click.ClickException(f"cannot reach kvindex at {url}: {exc.detail}") from exc
    except KvIndexClientError as exc:
        raise click.ClickException(str(exc)) from exc


def _show(
    value: Any, as_json: bool, render: Callable[[Console], list[Any]], *, wide: bool = False
) -> None:
    """A view command's output: ``value`` as JSON, or what ``render`` draws of it for the
    console it is given (the one console of :mod:`kvindex.clients.console`; ``wide``:
    rows as long as their content, on a terminal too)."""
    if as_json:
        click.echo(msgspec.json.format(msgspec.json.encode(value), indent=2))
    else:
        console = make_console(wide=wide)
        console.print(*render(console))


def _server_options(command: Callable[..., None]) -> Callable[..., None]:
    command = click.option(
        "--token",
        envvar="KVINDEX_API_TOKEN",
        help="Bearer token of the API (env KVINDEX_API_TOKEN).",
    )(command)
    return click.option(
        "--url",
        envvar="KVINDEX_URL",
        default=DEFAULT_URL,
        show_default=True,
        help="Base URL of the kvindex API (env KVINDEX_URL).",
    )(command)


def _json_option(command: Callable[..., None]) -> Callable[..., None]:
    return click.option("--json", "as_json", is_flag=True, help="Print the API's JSON body.")(
        command
    )


def _wide_option(command: Callable[..., None]) -> Callable[..., None]:
    return click.option(
        "--wide", is_flag=True, help="Every column (the table may wrap on a narrow terminal)."
    )(command)


def _prompt_options(command: Callable[..., None]) -> Callable[..., None]:
    """``--model`` and exactly one prompt source; ``--candidates``, ``--top-k``."""
    options = [
        click.option("--model", required=True, help="Model the prompt is for."),
        click.option("--text", help="Prompt text (tokenized by the server's tokenizer)."),
        click.option(
            "--tokens-file",
            type=click.Path(path_type=Path, dir_okay=False, exists=True),
            help="Token ids: a JSON list of ints, or ints separated by whitespace.",
        ),
        click.option(
            "--messages-file",
            type=click.Path(path_type=Path, dir_okay=False, exists=True),
            help="A JSON list of OpenAI chat messages (rendered by the server).",
        ),
        click.option("--candidates", help="Comma-separated replica ids to choose from."),
        click.option(
            "--top-k",
            type=click.IntRange(min=0),
            help="Show the best K candidates (0: all) [default: the server's default_top_k].",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def read_tokens(path: Path) -> list[int]:
    """Token ids from a JSON list of ints or whitespace-separated ints."""
    text = path.read_text()
    try:
        values = json.loads(text) if text.lstrip().startswith("[") else text.split()
        tokens = [int(v) for v in values]
    except (ValueError, TypeError) as exc:
        raise click.BadParameter(f"{path}: not a list of token ids ({exc})") from exc
    if any(isinstance(v, bool | float) for v in values):
        raise click.BadParameter(f"{path}: token ids must be integers")
    return tokens


def read_messages(path: Path) -> list[dict[str, Any]]:
    """OpenAI chat messages from a JSON list of objects."""
    try:
        messages = json.loads(path.read_text())
    except ValueError as exc:
        raise click.BadParameter(f"{path}: not JSON ({exc})") from exc
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise click.BadParameter(f"{path}: expected a JSON list of chat message objects")
    return messages


def prompt_fields(
    text: str | None, tokens_file: Path | None, messages_file: Path | None
) -> dict[str, Any]:
    """The ``/score`` prompt field for exactly one of the three sources."""
    given = [v for v in (text, tokens_file, messages_file) if v is not None]
    if len(given) != 1:
        raise click.UsageError("give exactly one of --text, --tokens-file, --messages-file")
    if text is not None:
        return {"prompt": text}
    if tokens_file is not None:
        return {"token_ids": read_tokens(tokens_file)}
    assert messages_file is not None
    return {"messages": read_messages(messages_file)}


def _candidates(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [c.strip() for c in value.split(",") if c.strip()]


# --- commands -----------------------------------------------------------------------------


@click.command()
@_server_options
@_prompt_options
@click.option(
    "--width",
    type=click.IntRange(MIN_STRIP, 512),
    help=f"Cells per strip; longer prompts group blocks per cell [default: what fits the"
    f" terminal, at most {STRIP_WIDTH}].",
)
@_wide_option
@_json_option
def residency(
    *,
    url: str,
    token: str | None,
    model: str,
    text: str | None,
    tokens_file: Path | None,
    messages_file: Path | None,
    candidates: str | None,
    top_k: int | None,
    width: int | None,
    wide: bool,
    as_json: bool,
) -> None:
    """Which replicas hold which of the prompt's blocks.

    One strip per replica, one cell per block (or per group of blocks on long prompts):
    green █ GPU, yellow █ CPU, blue █ other, ▌ a partly matched group, dim · a miss. The
    API reports matched blocks per tier, not their order: the matched prefix is drawn GPU,
    then CPU, then other, split in proportion to the counts. ★ marks the best replica.
    """
    fields = prompt_fields(text, tokens_file, messages_file)
    with connected(url, token) as client:
        answer = client.score(
            model, candidates=_candidates(candidates), top_k=top_k, dry_run=True, **fields
        )
    _show(
        answer,
        as_json,
        lambda console: render_residency(answer, width or fit_strip(console, answer, wide), wide),
        wide=wide,
    )


@click.command()
@_server_options
@_prompt_options
@click.option("--policy", help="Policy for this request (default: the model's or server's).")
@click.option("--workload", help="The request's workload, as [[rules]] match it (e.g. batch).")
@_wide_option
@_json_option
def score(
    *,
    url: str,
    token: str | None,
    model: str,
    text: str | None,
    tokens_file: Path | None,
    messages_file: Path | None,
    candidates: str | None,
    top_k: int | None,
    policy: str | None,
    workload: str | None,
    wide: bool,
    as_json: bool,
) -> None:
    """The routing decision for a prompt: the best candidates (``--top-k``), one line each
    (matched blocks, freshness, load, score); ``--wide`` adds each term of the policy's
    formula. The heading names the ``[[rules]]`` entry that chose the policy, if one did."""
    fields = prompt_fields(text, tokens_file, messages_file)
    with connected(url, token) as client:
        answer = client.score(
            model,
            candidates=_candidates(candidates),
            policy=policy,
            top_k=top_k,
            dry_run=True,
            workload=workload,
            **fields,
        )
    _show(answer, as_json, lambda _console: render_score(answer, wide), wide=wide)


@click.command()
@_server_options
@_wide_option
@_json_option
def replicas(*, url: str, token: str | None, wide: bool, as_json: bool) -> None:
    """Registered replicas: state, health (ejected by health checks or a breaker), streams
    (seq, blocks per tier, lag) and load; ``--wide`` adds their endpoints."""
    with connected(url, token) as client:
        views = client.replicas()
    _show(views, as_json, lambda _console: render_replicas(views, wide), wide=wide)


@click.command()
@_server_options
@_json_option
def stats(*, url: str, token: str | None, as_json: bool) -> None:
    """Index and ingestion totals."""
    with connected(url, token) as client:
        totals = client.stats()
    _show(totals, as_json, lambda _console: [render_stats(totals)])


def register_views(group: click.Group) -> None:
    """Add the view commands to the ``kvindex`` group."""
    for command in (residency, score, replicas, stats):
        group.add_command(command)
