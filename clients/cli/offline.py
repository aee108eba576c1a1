"""The commands that need no running fleet: ``demo``, ``simulate`` and ``analyze``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvindex.indexer.domain.errors import KvIndexError

if TYPE_CHECKING:  # imported where used: a command loads only what it runs
    from kvindex.clients.simulate.routing import PolicySpec
    from kvindex.clients.workloads.request_log import TokenizerOptions
    from kvindex.clients.workloads.trace import TraceRequest


def register_offline(group: click.Group) -> None:
    """Add ``demo``, ``simulate`` and ``analyze`` to ``group``."""
    for command in (demo, simulate, analyze):
        group.add_command(command)


@click.command()
@click.option("--replicas", default=4, show_default=True, help="Simulated replicas.")
@click.option("--requests", default=320, show_default=True, help="Requests per policy.")
@click.option("--seed", default=0, show_default=True, help="Workload seed.")
@click.option("--speed", default=20.0, show_default=True, help="Sim time compression.")
@click.option(
    "--json",
    "json_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Also write the settings and every figure to this file, as JSON.",
)
def demo(replicas: int, requests: int, seed: int, speed: float, json_path: Path | None) -> None:
    """Replay a seeded workload on simulated replicas: round-robin vs kv_aware."""
    from kvindex.clients.console import make_console
    from kvindex.clients.demo import DemoSettings, demo_main

    try:
        settings = DemoSettings(replicas=replicas, requests=requests, seed=seed, speed=speed)
        demo_main(settings, json_path, make_console())
    except KvIndexError as exc:
        raise click.ClickException(str(exc)) from exc


def _tokenizer_options(command: Callable[..., None]) -> Callable[..., None]:
    """How a request log is tokenized (``analyze``, ``simulate --request-log``)."""
    options = [
        click.option(
            "--tokenizer",
            "tokenizer_path",
            type=click.Path(path_type=Path, dir_okay=False, exists=True),
            help="The model's tokenizer.json (its chat template is read beside it).",
        ),
        click.option(
            "--chat-template",
            "chat_template_path",
            type=click.Path(path_type=Path, dir_okay=False, exists=True),
            help="A Jinja2 chat template or tokenizer_config.json (default: beside"
            " --tokenizer; else a plain '<|role|>' rendering).",
        ),
        click.option(
            "--tokenizer-url",
            help="A vLLM replica's root URL: its POST /tokenize tokenizes (instead of"
            " --tokenizer).",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _tokenizer_choice(
    tokenizer_path: Path | None, chat_template_path: Path | None, tokenizer_url: str | None
) -> TokenizerOptions:
    from kvindex.clients.workloads.request_log import TokenizerOptions

    return TokenizerOptions(tokenizer_path, chat_template_path, tokenizer_url)


_POLICIES = "round_robin,random,least_load,session_affinity,prefix_hash,kv_aware,kv_aware_instant"
_WORKLOADS = ("few_shot", "multi_turn", "rag", "system_prompts", "unique")
_DEFAULT_REQUESTS = 2000
_progress_option = click.option(
    "--progress-every",
    "progress_every_s",
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    help="Seconds between progress lines on stderr (0: none).",
)


def _policy_list(_ctx: click.Context, _param: click.Parameter, value: str) -> Any:
    from kvindex.clients.simulate.routing import parse_policy

    try:
        return tuple(parse_policy(p) for p in value.split(",") if p.strip())
    except KvIndexError as exc:
        raise click.BadParameter(str(exc)) from exc


def _variants(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> Any:
    from kvindex.clients.simulate.routing import parse_policy

    try:
        return tuple(parse_policy(v) for v in values)
    except KvIndexError as exc:
        raise click.BadParameter(str(exc)) from exc


@click.command()
@click.option(
    "--trace",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="Mooncake JSONL trace (plain or .gz).",
)
@click.option("--workload", type=click.Choice(_WORKLOADS), help="A built-in generator.")
@click.option(
    "--requests",
    "requests_arg",
    help=f"How many requests --workload generates ({_DEFAULT_REQUESTS}); or a route journal"
    " exported by kvindex why --export, replayed (its receipts need token ids).",
)
@click.option(
    "--request-log",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="A request log (one OpenAI request body a line, as kvindex analyze reads),"
    " tokenized with --tokenizer or --tokenizer-url.",
)
@_tokenizer_options
@click.option(
    "--rate",
    type=float,
    help="Arrivals/s (generators: default per workload; a request log: instead of its"
    " timestamps, default 20/s without them).",
)
@click.option("--limit", type=int, help="Read at most this many trace or log requests.")
@click.option("--replicas", default=8, show_default=True, help="Simulated replicas.")
@click.option(
    "--capacity-blocks", default=16_384, show_default=True, help="KV-cache blocks per replica."
)
@click.option("--block-size", default=16, show_default=True, help="Tokens per KV-cache block.")
@click.option(
    "--prefill-tps",
    default=12_000.0,
    show_default=True,
    help="Prompt tokens/s per replica (serial prefill).",
)
@click.option("--decode-tps", default=40.0, show_default=True, help="Output tokens/s per request.")
@click.option("--max-running", default=64, show_default=True, help="Batch limit per replica.")
@click.option(
    "--policies",
    "policies",
    default=_POLICIES,
    show_default=True,
    callback=_policy_list,
    help="Comma-separated. Every report ends with the oracle, the hit rate no policy beats.",
)
@click.option(
    "--variant",
    "variants",
    multiple=True,
    callback=_variants,
    help="A policy with weight overrides, e.g. kv_aware:waiting=0.5,cache=2 (repeatable).",
)
@click.option(
    "--event-delay",
    default=0.05,
    show_default=True,
    help="Seconds between a replica's event and the index applying it.",
)
@click.option(
    "--load-interval",
    default=0.0,
    show_default=True,
    help="Seconds between load reports to the router (0: every request; scraper: 2).",
)
@click.option("--speed", default=1.0, show_default=True, help="Arrival-time compression.")
@click.option(
    "--seed",
    default=0,
    show_default=True,
    help="Seed of --workload, of log arrivals drawn at --rate, and of tie-breaks.",
)
@click.option(
    "--via-zmq",
    is_flag=True,
    help="Send events over real ZeroMQ (loopback) to an in-process indexer.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Also write the settings and each policy's figures to this file, as JSON.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="PNG: every figure per policy, and hit rate over time (needs kvindex[plot]).",
)
@_progress_option
def simulate(
    trace: Path | None,
    workload: str | None,
    requests_arg: str | None,
    request_log: Path | None,
    tokenizer_path: Path | None,
    chat_template_path: Path | None,
    tokenizer_url: str | None,
    rate: float | None,
    limit: int | None,
    policies: tuple[PolicySpec, ...],
    variants: tuple[PolicySpec, ...],
    event_delay: float,
    load_interval: float,
    speed: float,
    seed: int,
    via_zmq: bool,
    json_path: Path | None,
    plot_path: Path | None,
    progress_every_s: float,
    **fleet: Any,
) -> None:
    """Replay a trace, a request log or a generated workload through a simulated fleet,
    once per policy."""
    from kvindex.clients.console import make_console
    from kvindex.clients.simulate.fleet import FleetSettings
    from kvindex.clients.simulate.run import SimulateSettings, simulate_main
    from kvindex.clients.workloads.generators import WORKLOADS, GeneratorSettings
    from kvindex.clients.workloads.trace import read_trace

    journal = _journal_of(workload, requests_arg)
    if journal is None:
        request_log = request_log or _deprecated_log(workload, requests_arg)
    if sum(x is not None for x in (trace, workload, request_log, journal)) != 1:
        raise click.UsageError(
            "give exactly one of --trace FILE, --request-log LOG.jsonl, --requests JOURNAL"
            " or --workload NAME"
        )
    try:
        if trace is not None:
            reqs, source = read_trace(trace, limit=limit), trace.name
        elif journal is not None:
            reqs, source = _journal_requests(journal, limit, fleet["block_size"]), journal.name
        elif request_log is not None:
            options = _tokenizer_choice(tokenizer_path, chat_template_path, tokenizer_url)
            reqs = _logged_requests(request_log, options, limit, rate, seed)
            source = request_log.name
        else:
            assert workload is not None
            count = _request_count(requests_arg)
            reqs = WORKLOADS[workload](GeneratorSettings(count, rate, seed))
            source = f"{workload} (seed {seed})"
        settings = SimulateSettings(
            fleet=FleetSettings(**fleet),
            policies=policies + variants,
            event_delay_s=event_delay,
            load_interval_s=load_interval,
            speed=speed,
            seed=seed,
            via_zmq=via_zmq,
        )
        simulate_main(
            settings,
            reqs,
            source=source,
            console=make_console(),
            json_path=json_path,
            plot_path=plot_path,
            progress_every_s=progress_every_s,
        )
    except KvIndexError as exc:
        raise click.ClickException(str(exc)) from exc


def _journal_of(workload: str | None, requests_arg: str | None) -> Path | None:
    """``--requests FILE`` naming a route journal's export (without ``--workload``)."""
    from kvindex.clients.workloads.journal_trace import is_journal

    if workload is not None or requests_arg is None or requests_arg.strip().isdigit():
        return None
    path = Path(requests_arg)
    return path if path.is_file() and is_journal(path) else None


def _journal_requests(path: Path, limit: int | None, block_size: int) -> list[TraceRequest]:
    """The export's replayable receipts; what was skipped, and a block size not the
    journal's, said on stderr."""
    from kvindex.clients.console import make_console
    from kvindex.clients.workloads.journal_trace import read_journal

    journal = read_journal(path, limit=limit)
    stderr = make_console(sys.stderr)
    if journal.num_skipped:
        stderr.print(f"{path.name}: skipped {journal.num_skipped} receipts without token ids")
    if journal.block_sizes - {block_size}:
        sizes = ", ".join(str(s) for s in sorted(journal.block_sizes))
        stderr.print(f"{path.name}: routed with block size {sizes}; simulated with {block_size}")
    return journal.requests


def _deprecated_log(workload: str | None, requests_arg: str | None) -> Path | None:
    """``--requests LOG.jsonl`` without ``--workload``: the old spelling of
    ``--request-log``, still read this release, with a warning."""
    if workload is not None or requests_arg is None or requests_arg.strip().isdigit():
        return None
    path = Path(requests_arg)
    if not path.is_file():
        raise click.BadParameter(
            f"a number of requests for --workload, got {requests_arg!r}"
            " (a request log is --request-log PATH)",
            param_hint="--requests",
        )
    _warn_old_log_spelling(path, " (--requests is how many --workload generates)")
    return path


def _warn_old_log_spelling(path: Path, why: str = "") -> None:
    click.echo(
        f"warning: --requests {path} reads a request log for the last release:"
        f" use --request-log {path}{why}",
        err=True,
    )


@click.command()
@click.option(
    "--request-log",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="Request log: one OpenAI request body a line (or {'body': ...}), plain or .gz.",
)
@click.option(
    "--requests",
    "requests_path",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="The old spelling of --request-log, read this release with a warning.",
)
@_tokenizer_options
@click.option("--block-size", default=16, show_default=True, help="Tokens per KV-cache block.")
@click.option("--limit", type=int, help="Read at most this many requests.")
@click.option(
    "--json",
    "json_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Also write the whole report to this file, as JSON.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="PNG: share of prompt tokens cacheable by position, before and after the fix"
    " (needs kvindex[plot]).",
)
@_progress_option
def analyze(
    request_log: Path | None,
    requests_path: Path | None,
    tokenizer_path: Path | None,
    chat_template_path: Path | None,
    tokenizer_url: str | None,
    block_size: int,
    limit: int | None,
    json_path: Path | None,
    plot_path: Path | None,
    progress_every_s: float,
) -> None:
    """What a request log could reuse, what breaks its prefixes, and which policy fits."""
    from kvindex.clients.analyze.run import AnalyzeSettings, analyze_main
    from kvindex.clients.console import make_console

    if (request_log is None) == (requests_path is None):
        raise click.UsageError("give the log once: --request-log LOG.jsonl")
    if requests_path is not None:
        _warn_old_log_spelling(requests_path)
    log = request_log or requests_path
    assert log is not None
    try:
        options = _tokenizer_choice(tokenizer_path, chat_template_path, tokenizer_url)
        settings = AnalyzeSettings(
            options, block_size=block_size, limit=limit, progress_every_s=progress_every_s
        )
        analyze_main(
            log,
            settings,
            console=make_console(),
            json_path=json_path,
            plot_path=plot_path,
        )
    except KvIndexError as exc:
        raise click.ClickException(str(exc)) from exc


def _request_count(value: str | None) -> int:
    if value is None:
        return _DEFAULT_REQUESTS
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter(
            f"with --workload, a number of requests, got {value!r}", param_hint="--requests"
        ) from None


def _logged_requests(
    log: Path, options: TokenizerOptions, limit: int | None, rate: float | None, seed: int
) -> list[TraceRequest]:
    """The log's requests, tokenized, as the simulator replays them; skipped lines are
    reported on stderr."""
    import asyncio

    from kvindex.clients.console import make_console
    from kvindex.clients.workloads.log_trace import logged_trace
    from kvindex.clients.workloads.request_log import read_tokenized_log

    done, problems = asyncio.run(read_tokenized_log(log, options, limit=limit))
    stderr = make_console(sys.stderr)
    for problem in problems.kept:
        stderr.print(f"{log.name}: skipped {problem}")
    if problems.count > len(problems.kept):
        stderr.print(f"{log.name}: ... and {problems.count - len(problems.kept)} more")
    return logged_trace(done, rate=rate, seed=seed)
