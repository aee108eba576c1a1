"""The operator views of a running kvindex API: ``residency``, ``score``, ``replicas``, ``stats``.

Thin shells over :class:`kvindex.clients.http.KvIndexClient`, drawn by
:mod:`kvindex.clients.cli.render` (``--json``: the API's body); a failure is a one-line error."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from rich.console import Console

    from kvindex.api.schemas import ScoreResponse
    from kvindex.clients.http import KvIndexClient

__all__ = ["fit_strip", "prompt_fields", "read_messages", "read_tokens", "register_views"]

DEFAULT_URL = "http://127.0.0.1:8000"
STRIP_WIDTH = 64
"""Most cells of a residency strip; longer prompts group several blocks per cell."""
MIN_STRIP = 8
"""Fewest cells of a residency strip, however narrow the terminal."""


def fit_strip(console: Console, answer: ScoreResponse, wide: bool = False) -> int:
    """Cells per strip for which the residency table fits ``console`` (off a terminal: the most)."""
    from kvindex.clients.cli.render import render_residency
    from kvindex.clients.console import natural_width

    spare = console.width - natural_width(console, render_residency(answer, MIN_STRIP, wide)[1])
    return max(MIN_STRIP, min(STRIP_WIDTH, MIN_STRIP + spare))


@contextmanager
def connected(url: str, token: str | None) -> Iterator[KvIndexClient]:
    """A client for ``url``; its failures leave as one-line :class:`click.ClickException`."""
    from kvindex.clients.http import (
        KvIndexClient,
        KvIndexClientError,
        UnreachableError,
    )

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
    """``value`` as JSON, or what ``render`` draws of it (``wide``: rows never wrapped)."""
    import msgspec

    from kvindex.clients.console import make_console

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

    One strip per replica, one cell per block or group of blocks: █ matched (green GPU,
    yellow CPU, blue other), ▌ partly, · a miss; ★ marks the best replica."""
    from kvindex.clients.cli.render import render_residency

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
    """The routing decision for a prompt: the best candidates, one line each.

    The heading names the policy (and the rule that chose it) and why the best won a tie;
    --wide adds each term of the policy's formula."""
    from kvindex.clients.cli.render import render_score

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
    """Registered replicas: state, health, streams and load."""
    from kvindex.clients.cli.render import render_replicas

    with connected(url, token) as client:
        views = client.replicas()
    _show(views, as_json, lambda _console: render_replicas(views, wide), wide=wide)


@click.command()
@_server_options
@_json_option
def stats(*, url: str, token: str | None, as_json: bool) -> None:
    """Index and ingestion totals."""
    from kvindex.clients.cli.render import render_stats

    with connected(url, token) as client:
        totals = client.stats()
    _show(totals, as_json, lambda _console: [render_stats(totals)])


def register_views(group: click.Group) -> None:
    for command in (residency, score, replicas, stats):
        group.add_command(command)
