"""The ``kvindex`` command line: a thin shell over the library."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvindex.api.config.settings import ReadPathSettings, api_settings_of
from kvindex.api.http.server import serve as run_server
from kvindex.api.http.server import serve_api
from kvindex.clients.cli.check_hash import check_hash_command
from kvindex.clients.cli.log_format import LOG_FORMATS, LogFormat, configure_logging
from kvindex.clients.cli.status import FleetStatus, StatusLog
from kvindex.clients.cli.views import register_views
from kvindex.clients.console import make_console
from kvindex.clients.fake_vllm.replica import ReplicaSim, ReplicaSimError, ReplicaSimSettings
from kvindex.clients.proxy.service import serve_proxy
from kvindex.clients.proxy.settings import proxy_settings_of
from kvindex.indexer.config.loading import ConfigFile
from kvindex.indexer.config.settings import IndexerSettings, load_settings, load_store_settings
from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.fleet.registry import Freshness, fleet_totals
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.service import IndexerService

if TYPE_CHECKING:  # imported where used: `serve` must not pay for tokenizers and numpy
    from kvindex.clients.simulate.routing import PolicySpec
    from kvindex.clients.workloads.request_log import TokenizerOptions
    from kvindex.clients.workloads.trace import TraceRequest


def _replica_option(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> Any:
    try:
        return tuple(ReplicaSpec.parse(v) for v in values)
    except KvIndexError as exc:
        raise click.BadParameter(str(exc)) from exc


def _indexer_options(command: Callable[..., None]) -> Callable[..., None]:
    """The write-path options every process that runs an indexer takes."""
    options = [
        click.option(
            "--config",
            "config",
            type=click.Path(path_type=Path, dir_okay=False),
            help="TOML settings file (indexer keys; [api], [[models]]; [proxy] for proxy).",
        ),
        click.option(
            "--replica",
            "replicas",
            multiple=True,
            callback=_replica_option,
            help="id=r1,model=M,events=tcp://host:5557[,replay=...][,url=...][,dp_size=N]",
        ),
        click.option("--bind", help="Bind one SUB here for replicas that connect to us."),
        click.option("--store", type=click.Choice(["memory", "redis"]), help="Index store."),
        click.option("--redis-url", help="Redis URL (with --store redis)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@click.group()
@click.version_option(package_name="kvindex", prog_name="kvindex")
@click.option("-v", "--verbose", is_flag=True, help="Log at DEBUG level.")
@click.option(
    "--log-format",
    type=click.Choice(LOG_FORMATS),
    default="text",
    show_default=True,
    envvar="KVINDEX_LOG_FORMAT",
    help="Log lines on stderr: text, or one JSON object per line (ts, level, logger,"
    " message, extra fields). Env KVINDEX_LOG_FORMAT.",
)
@click.option(
    "--log-repeat-s",
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    envvar="KVINDEX_LOG_REPEAT_S",
    help="Log the same kvindex warning at most once per this many seconds, then say how"
    " many were held back (0: log every one).",
)
def main(verbose: bool, log_format: LogFormat, log_repeat_s: float) -> None:
    """kvindex: where every KV-cache block of a vLLM fleet lives."""
    configure_logging(
        level=logging.DEBUG if verbose else logging.INFO,
        log_format=log_format,
        repeat_window_s=log_repeat_s,
    )
    if not verbose:  # httpx logs one line per request (the /metrics scraper: several a second)
        logging.getLogger("httpx").setLevel(logging.WARNING)


_ingest_workers_option = click.option(
    "--ingest-workers",
    type=click.IntRange(min=0),
    help="Ingest workers of the memory store, each with its share of the connect-mode"
    " streams (else env KVINDEX_INGEST_WORKERS, ingest_workers; 0, the default: one per"
    " two cores available, 1 to 2).",
)
_stats_every_option = click.option(
    "--stats-every",
    default=5.0,
    show_default=True,
    help="Log one status line (the fleet's totals) every N seconds (0: never).",
)


@main.command()
@_indexer_options
@click.option(
    "--status-port",
    type=int,
    help="Port of /metrics, /healthz, /readyz (default 8090 on status_host 127.0.0.1;"
    " 0: any free one, logged; -1: none).",
)
@_ingest_workers_option
@_stats_every_option
def indexer(
    config: Path | None,
    replicas: tuple[ReplicaSpec, ...],
    bind: str | None,
    store: str | None,
    redis_url: str | None,
    status_port: int | None,
    ingest_workers: int | None,
    stats_every: float,
) -> None:
    """Run the write path: subscribe to replicas and keep the block index."""
    try:
        settings = load_settings(
            config,
            overrides={
                "bind": bind,
                "store": store,
                "redis_url": redis_url,
                "status_port": status_port,
                "ingest_workers": ingest_workers,
            },
            extra_replicas=replicas,
        )
    except KvIndexError as exc:
        raise click.ClickException(str(exc)) from exc
    _run_indexer(settings, stats_every)


_token_file_option = click.option(
    "--token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="File holding the API's bearer token (else env KVINDEX_API_TOKEN[_FILE], [api]).",
)
_access_log_option = click.option(
    "--access-log/--no-access-log",
    default=None,
    help="Log one line per HTTP request (method, path, route, status, ms) in the log format"
    " (else env KVINDEX_API_ACCESS_LOG, [api] access_log; default off).",
)


@main.command()
@_indexer_options
@click.option("--host", help="API listen address (default 127.0.0.1).")
@click.option("--port", type=int, help="API listen port (default 8000).")
@_token_file_option
@_access_log_option
@_ingest_workers_option
@_stats_every_option
def serve(
    config: Path | None,
    replicas: tuple[ReplicaSpec, ...],
    bind: str | None,
    store: str | None,
    redis_url: str | None,
    host: str | None,
    port: int | None,
    token_file: Path | None,
    access_log: bool | None,
    ingest_workers: int | None,
    stats_every: float,
) -> None:
    """Run the indexer and the scoring API in one process."""
    try:
        file = ConfigFile.read(config)
        settings = load_settings(
            file,
            overrides={
                "bind": bind,
                "store": store,
                "redis_url": redis_url,
                "ingest_workers": ingest_workers,
            },
            extra_replicas=replicas,
        )
        api = api_settings_of(
            file,
            overrides={
                "host": host,
                "port": port,
                "auth_token_file": token_file,
                "access_log": access_log,
            },
        )
    except KvIndexError as exc:
        raise click.ClickException(str(exc)) from exc
    make_console().print(f"kvindex serve ({settings.store} store) on http://{api.host}:{api.port}")
    try:
        run_server(
            settings,
            api,
            watch=lambda indexer: StatusLog(lambda: _fleet_status(indexer), stats_every),
        )
    except KvIndexError as exc:  # the indexer could not start (e.g. out of open files)
        raise click.ClickException(str(exc)) from exc


@main.command()
@click.option(
    "--redis-url",
    help="The Redis the indexer writes (else env KVINDEX_REDIS_URL or redis_url in --config:"
    " keeps a password out of the process list).",
)
@click.option("--host", help="API listen address (default 127.0.0.1).")
@click.option("--port", type=int, help="API listen port (default 8000).")
@click.option(
    "--config",
    "config",
    type=click.Path(path_type=Path, dir_okay=False),
    help="TOML settings file ([api], [[models]], redis_url, redis_prefix, stale_after_s).",
)
@_token_file_option
@_access_log_option
def api(
    redis_url: str | None,
    host: str | None,
    port: int | None,
    config: Path | None,
    token_file: Path | None,
    access_log: bool | None,
) -> None:
    """Run the scoring API alone on the Redis a `kvindex indexer --store redis` writes."""
    try:
        file = ConfigFile.read(config)
        store = load_store_settings(file, overrides={"store": "redis", "redis_url": redis_url})
        api_settings = api_settings_of(
            file,
            overrides={
                "host": host,
                "port": port,
                "auth_token_file": token_file,
                "access_log": access_log,
            },
        )
    except KvIndexError as exc:
        raise click.ClickException(str(exc)) from exc
    where = f"http://{api_settings.host}:{api_settings.port}"
    make_console().print(f"kvindex api (redis fleet, index and load) on {where}")
    try:
        serve_api(ReadPathSettings(store, api_settings))
    except KvIndexError as exc:  # e.g. an index this version does not read
        raise click.ClickException(str(exc)) from exc


@main.command()
@_indexer_options
@click.option("--host", help="Proxy listen address (default 127.0.0.1).")
@click.option("--port", type=int, help="Proxy listen port (default 8000).")
@click.option(
    "--max-attempts", type=int, help="Replicas tried per request before its first byte (3)."
)
@click.option("--connect-timeout-s", type=float, help="Connect timeout per replica (2).")
@click.option("--first-byte-timeout-s", type=float, help="Wait for an answer to start (300).")
@click.option(
    "--stream-idle-timeout-s",
    type=float,
    help="Longest gap between two chunks of an answer (120).",
)
@click.option("--total-timeout-s", type=float, help="Whole request, stream included (900).")
@click.option(
    "--drain-timeout-s",
    type=float,
    help="On SIGTERM, let the requests being answered finish this long at most (30).",
)
@click.option(
    "--token-file",
    "auth_token_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="File holding the bearer token clients must send"
    " (else env KVINDEX_PROXY_AUTH_TOKEN[_FILE], [proxy]; default: none asked).",
)
@click.option(
    "--lease-ttl-s",
    type=float,
    help="A dead proxy's requests in flight stop counting as load after this long (10).",
)
def proxy(
    config: Path | None,
    replicas: tuple[ReplicaSpec, ...],
    bind: str | None,
    store: str | None,
    redis_url: str | None,
    host: str | None,
    port: int | None,
    **forwarding: Any,
) -> None:
    """Serve the OpenAI API and forward each request to the replica kvindex picks.

    Settings: [proxy] of --config < env KVINDEX_PROXY_<NAME> < these options."""
    try:
        file = ConfigFile.read(config)
        settings = load_settings(
            file,
            overrides={"bind": bind, "store": store, "redis_url": redis_url},
            extra_replicas=replicas,
        )
        api_settings = api_settings_of(file, overrides={"host": host, "port": port})
        proxy_settings = proxy_settings_of(file, overrides=forwarding)
    except KvIndexError as exc:
        raise click.ClickException(str(exc)) from exc
    where = f"http://{api_settings.host}:{api_settings.port}"
    make_console().print(f"kvindex proxy ({settings.store} store) on {where}/v1")
    try:
        serve_proxy(settings, api_settings, proxy_settings)
    except KvIndexError as exc:  # e.g. an index this version does not read
        raise click.ClickException(str(exc)) from exc


@main.command("replica-sim")
@click.option("--id", "replica_id", default="r1", show_default=True, help="Replica id.")
@click.option("--model", default="demo-model", show_default=True, help="Served model name.")
@click.option("--host", default="127.0.0.1", show_default=True, help="HTTP listen address.")
@click.option("--port", default=8001, show_default=True, help="HTTP listen port.")
@click.option(
    "--events",
    help="KV-event PUB endpoint (vLLM's rule: bind with '*', else connect)."
    " [default: bind tcp://127.0.0.1:5557; 'tcp://*:5557' for every interface]",
)
@click.option(
    "--replay",
    default="tcp://127.0.0.1:5558",
    show_default=True,
    help="Replay ROUTER endpoint ('tcp://*:5558' for every interface; '' for none).",
)
@click.option("--bind-events", is_flag=True, help="Bind --events even without '*'.")
@click.option("--encoding", type=click.Choice(["map", "array"]), default="map", show_default=True)
@click.option("--replay-layout", type=click.Choice(["topic", "legacy"]), default="topic")
@click.option("--block-size", default=16, show_default=True)
@click.option("--capacity-blocks", default=1024, show_default=True)
@click.option("--prefill-tps", default=8000.0, show_default=True)
@click.option("--decode-tps", default=50.0, show_default=True)
@click.option("--max-running", default=8, show_default=True)
@click.option("--speed", default=1.0, show_default=True, help="Time compression factor.")
@click.option("--seed", type=int, help="Block-hash root seed (default: random).")
@click.option("--lora", "lora_names", multiple=True, help="A LoRA name served (repeatable).")
@click.option(
    "--send-hwm", default=0, show_default=True, help="PUB high-water mark (0: unbounded)."
)
@click.option(
    "--send-buffer-bytes",
    default=0,
    show_default=True,
    help="PUB kernel send buffer (0: the OS default).",
)
@click.option("--api-key", help="Require this bearer token on /v1 routes (vLLM's --api-key).")
@click.option(
    "--fail-status",
    default=0,
    show_default=True,
    help="Test knob: answer every completion with this status (0: never).",
)
@click.option(
    "--stream-stall-s",
    default=0.0,
    show_default=True,
    help="Test knob: stall each stream this long after its first chunk (0: never).",
)
def replica_sim(
    replica_id: str, bind_events: bool, lora_names: tuple[str, ...], replay: str, **kw: Any
) -> None:
    """Run a simulated vLLM replica (HTTP API + KV events) until SIGINT/SIGTERM."""
    try:
        settings = ReplicaSimSettings(
            id=replica_id,
            bind_events=True if bind_events else None,
            lora_names=lora_names,
            replay=replay or None,
            **kw,
        )
    except ReplicaSimError as exc:
        raise click.ClickException(str(exc)) from exc
    sim = ReplicaSim(settings)
    sim.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    make_console().print(
        f"replica-sim {settings.id} on {sim.base_url}, events {sim.events_endpoint} "
        f"(topic {settings.topic}), replay {sim.replay_endpoint}"
    )
    try:
        while not stop.wait(1.0):
            pass
    finally:
        sim.stop()


@main.command()
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
    from kvindex.clients.demo import DemoSettings, demo_main  # noqa: PLC0415 (servers)

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
    from kvindex.clients.workloads.request_log import TokenizerOptions  # noqa: PLC0415 (tokenizers)

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
    from kvindex.clients.simulate.routing import parse_policy  # noqa: PLC0415 (the scorer)

    try:
        return tuple(parse_policy(p) for p in value.split(",") if p.strip())
    except KvIndexError as exc:
        raise click.BadParameter(str(exc)) from exc


def _variants(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> Any:
    from kvindex.clients.simulate.routing import parse_policy  # noqa: PLC0415 (the scorer)

    try:
        return tuple(parse_policy(v) for v in values)
    except KvIndexError as exc:
        raise click.BadParameter(str(exc)) from exc


@main.command()
@click.option(
    "--trace",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="Mooncake JSONL trace (plain or .gz).",
)
@click.option("--workload", type=click.Choice(_WORKLOADS), help="A built-in generator.")
@click.option(
    "--requests",
    "requests_arg",
    help=f"How many requests --workload generates ({_DEFAULT_REQUESTS}).",
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
    from kvindex.clients.simulate.fleet import FleetSettings  # noqa: PLC0415
    from kvindex.clients.simulate.run import SimulateSettings, simulate_main  # noqa: PLC0415
    from kvindex.clients.workloads.generators import WORKLOADS, GeneratorSettings  # noqa: PLC0415
    from kvindex.clients.workloads.trace import read_trace  # noqa: PLC0415

    request_log = request_log or _deprecated_log(workload, requests_arg)
    if sum(x is not None for x in (trace, workload, request_log)) != 1:
        raise click.UsageError(
            "give exactly one of --trace FILE, --request-log LOG.jsonl or --workload NAME"
        )
    try:
        if trace is not None:
            reqs, source = read_trace(trace, limit=limit), trace.name
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


@main.command()
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
    from kvindex.clients.analyze.run import AnalyzeSettings, analyze_main  # noqa: PLC0415 (numpy)

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
    from kvindex.clients.workloads.log_trace import logged_trace  # noqa: PLC0415
    from kvindex.clients.workloads.request_log import read_tokenized_log  # noqa: PLC0415

    done, problems = asyncio.run(read_tokenized_log(log, options, limit=limit))
    stderr = make_console(sys.stderr)
    for problem in problems.kept:
        stderr.print(f"{log.name}: skipped {problem}")
    if problems.count > len(problems.kept):
        stderr.print(f"{log.name}: ... and {problems.count - len(problems.kept)} more")
    return logged_trace(done, rate=rate, seed=seed)


def _run_indexer(settings: IndexerSettings, stats_every: float) -> None:
    service = IndexerService.build(settings, with_status=True)
    try:
        service.start()
    except KvIndexError as exc:
        service.stop()
        raise click.ClickException(str(exc)) from exc
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    where = service.subscriber.bound_endpoint or "configured replicas"
    status = ""
    if service.status is not None:
        status = f", status on {service.status.server.url}"
    make_console().print(f"kvindex indexer ({settings.store} store) listening on {where}{status}")
    try:
        with StatusLog(lambda: _fleet_status(service), stats_every):
            while not stop.wait(3600):
                pass
    finally:
        service.stop()


def _fleet_status(service: IndexerService) -> FleetStatus:
    """The totals of ``service``'s registry and index now (one index read per stream)."""
    statuses = service.registry.statuses()
    names: dict[Freshness, list[str]] = {state: [] for state in Freshness}
    for status in statuses:
        names[status.freshness].append(str(status.stream))
    lags = [s.health.lag_s for s in statuses if s.health.lag_s is not None]
    totals = fleet_totals(service.registry, service.index, statuses=statuses)
    return FleetStatus(totals, names, max(lags, default=None))


register_views(main)  # residency, score, replicas, stats (clients/cli/views.py)
main.add_command(check_hash_command)  # check-hash (clients/cli/check_hash.py)
