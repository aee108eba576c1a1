"""The ``kvindex`` command line: a thin shell over the library.

Each command imports what it runs, so that ``kvindex --version`` and the views start quickly.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvindex.clients.cli.check_hash import check_hash_command
from kvindex.clients.cli.log_format import add_log_options, apply_log_options, log_options
from kvindex.clients.cli.process import check_port, run_indexer, say, stop_event
from kvindex.clients.cli.views import register_views
from kvindex.clients.console import make_console
from kvindex.clients.demo import DemoSettings, demo_main
from kvindex.clients.simulate.fleet import FleetSettings
from kvindex.clients.simulate.routing import PolicySpec, parse_policy
from kvindex.clients.simulate.run import DEFAULT_POLICIES, SimulateSettings, simulate_main
from kvindex.clients.workloads import (
    WORKLOADS,
    GeneratorSettings,
    TraceRequest,
    logged_trace,
    read_trace,
)
from kvindex.indexer.domain.errors import KvIndexError

if TYPE_CHECKING:
    from kvindex.api.config.settings import ApiSettings
    from kvindex.clients.request_log import TokenizerOptions
    from kvindex.indexer.fleet.replica import ReplicaSpec

_DEMO = DemoSettings()


def _replica_option(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> Any:
    from kvindex.indexer.fleet.replica import ReplicaSpec  # noqa: PLC0415

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


class _Group(click.Group):
    """Lists every command with its whole summary (wrapped, never cut short)."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        commands = [(name, self.get_command(ctx, name)) for name in self.list_commands(ctx)]
        rows = [(n, c.get_short_help_str(limit=1_000)) for n, c in commands if c and not c.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=_Group, params=log_options(group=True))
@click.version_option(package_name="kvindex", prog_name="kvindex")
def main() -> None:
    """kvindex: where every KV-cache block of a vLLM fleet lives."""
    apply_log_options(click.get_current_context())


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
    from kvindex.indexer.config.settings import load_settings  # noqa: PLC0415

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
    run_indexer(settings, stats_every)


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


def _api_settings(config: Path | None, overrides: dict[str, Any]) -> ApiSettings:
    """``[api]``, ``[[models]]`` and ``[[rules]]`` of ``config`` < env < ``overrides``."""
    from kvindex.api.config.settings import load_api_settings  # noqa: PLC0415
    from kvindex.indexer.config.settings import read_toml  # noqa: PLC0415

    file_values = read_toml(config) if config is not None else {}
    return load_api_settings(
        file_values.get("api"),
        file_values.get("models"),
        rules=file_values.get("rules"),
        overrides=overrides,
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
    from kvindex.api.http.server import serve as run_server  # noqa: PLC0415
    from kvindex.clients.cli.status import StatusLog, fleet_status  # noqa: PLC0415
    from kvindex.indexer.config.settings import load_settings  # noqa: PLC0415

    try:
        settings = load_settings(
            config,
            overrides={
                "bind": bind,
                "store": store,
                "redis_url": redis_url,
                "ingest_workers": ingest_workers,
            },
            extra_replicas=replicas,
        )
        api = _api_settings(
            config,
            {"host": host, "port": port, "auth_token_file": token_file, "access_log": access_log},
        )
    except KvIndexError as exc:
        raise click.ClickException(str(exc)) from exc
    check_port(api.host, api.port)
    say(f"kvindex serve ({settings.store} store) on http://{api.host}:{api.port}")
    try:
        run_server(
            settings,
            api,
            watch=lambda indexer: StatusLog(lambda: fleet_status(indexer), stats_every),
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
    """Run the scoring API alone, on the Redis an indexer with --store redis writes."""
    from kvindex.api.http.server import serve_api  # noqa: PLC0415
    from kvindex.indexer.config.settings import load_settings  # noqa: PLC0415

    try:
        settings = load_settings(config, overrides={"store": "redis", "redis_url": redis_url})
        api_settings = _api_settings(
            config,
            {"host": host, "port": port, "auth_token_file": token_file, "access_log": access_log},
        )
    except KvIndexError as exc:
        raise click.ClickException(str(exc)) from exc
    check_port(api_settings.host, api_settings.port)
    where = f"http://{api_settings.host}:{api_settings.port}"
    say(f"kvindex api (redis fleet, index and load) on {where}")
    try:
        serve_api(settings.redis_url, settings, api_settings)
    except KvIndexError as exc:  # e.g. an index this version does not read
        raise click.ClickException(str(exc)) from exc


@main.command()
@_indexer_options
@click.option("--host", help="Proxy listen address (default 127.0.0.1).")
@click.option("--port", type=int, default=8080, show_default=True, help="Proxy listen port.")
@click.option(
    "--max-attempts", type=int, help="Replicas tried per request before its first byte (3)."
)
@click.option("--connect-timeout-s", type=float, help="Connect timeout per replica (2).")
@click.option("--first-byte-timeout-s", type=float, help="Wait for an answer to start (300).")
@click.option("--stream-idle-timeout-s", type=float, help="Longest gap between two chunks (120).")
@click.option("--total-timeout-s", type=float, help="Whole request, stream included (900).")
@click.option("--drain-timeout-s", type=float, help="On SIGTERM, answers get this long (30).")
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
    from kvindex.clients.proxy.service import serve_proxy  # noqa: PLC0415
    from kvindex.clients.proxy.settings import load_proxy_settings  # noqa: PLC0415
    from kvindex.indexer.config.settings import load_settings, read_toml  # noqa: PLC0415

    try:
        settings = load_settings(
            config,
            overrides={"bind": bind, "store": store, "redis_url": redis_url},
            extra_replicas=replicas,
        )
        api_settings = _api_settings(config, {"host": host, "port": port})
        file_values = read_toml(config) if config is not None else {}
        proxy_settings = load_proxy_settings(file_values.get("proxy"), overrides=forwarding)
    except KvIndexError as exc:
        raise click.ClickException(str(exc)) from exc
    check_port(api_settings.host, api_settings.port)
    where = f"http://{api_settings.host}:{api_settings.port}"
    say(f"kvindex proxy ({settings.store} store) on {where}/v1")
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
@click.option("--send-hwm", default=0, show_default=True, help="PUB high-water mark (0: none).")
@click.option("--send-buffer-bytes", default=0, show_default=True, help="PUB buffer (0: OS's).")
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
    """Run a simulated vLLM replica (HTTP API and KV events) until SIGINT or SIGTERM."""
    from kvindex.clients.fake_vllm import replica  # noqa: PLC0415 (fastapi)

    try:
        settings = replica.ReplicaSimSettings(
            id=replica_id,
            bind_events=True if bind_events else None,
            lora_names=lora_names,
            replay=replay or None,
            **kw,
        )
    except replica.ReplicaSimError as exc:
        raise click.ClickException(str(exc)) from exc
    check_port(settings.host, settings.port)
    sim = replica.ReplicaSim(settings)
    try:
        sim.start()
    except replica.EndpointInUseError as exc:
        raise click.ClickException(f"{exc}: choose another with --{exc.setting}") from exc
    except replica.ReplicaSimError as exc:  # e.g. the HTTP server failed at start-up
        raise click.ClickException(str(exc)) from exc
    stop = stop_event()
    how = "binds" if settings.events_bound else "connects to"
    say(
        f"replica-sim {settings.id} on {sim.base_url}; events: {how} {sim.events_endpoint}"
        f" (topic {settings.topic}); replay: {sim.replay_endpoint or 'none'}"
    )
    try:
        while not stop.wait(3600):
            pass
    finally:
        sim.stop()


@main.command()
@click.option("--replicas", default=_DEMO.replicas, show_default=True, help="Simulated replicas.")
@click.option("--requests", default=_DEMO.requests, show_default=True, help="Requests per policy.")
@click.option("--seed", default=_DEMO.seed, show_default=True, help="Workload seed.")
@click.option("--speed", default=_DEMO.speed, show_default=True, help="Sim time compression.")
@click.option("--json", "json_path", type=click.Path(path_type=Path, dir_okay=False))
def demo(replicas: int, requests: int, seed: int, speed: float, json_path: Path | None) -> None:
    """Replay a seeded workload on simulated replicas: round-robin vs kv_aware."""
    try:
        settings = DemoSettings(replicas=replicas, requests=requests, seed=seed, speed=speed)
        demo_main(settings, json_path, make_console())
    except KvIndexError as exc:
        raise click.ClickException(str(exc)) from exc


def _tokenizer_options(command: Callable[..., None]) -> Callable[..., None]:
    """How a request log is tokenized (``analyze``, ``simulate --requests``)."""
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
            " --tokenizer; else a plain '<|role|>' rendering, see the README).",
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
    from kvindex.clients.request_log import TokenizerOptions  # noqa: PLC0415 (tokenizers)

    return TokenizerOptions(tokenizer_path, chat_template_path, tokenizer_url)


_SIM = FleetSettings()


def _policy_list(_ctx: click.Context, _param: click.Parameter, value: str) -> Any:
    try:
        return tuple(parse_policy(p) for p in value.split(",") if p.strip())
    except KvIndexError as exc:
        raise click.BadParameter(str(exc)) from exc


def _variants(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> Any:
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
@click.option("--workload", type=click.Choice(sorted(WORKLOADS)), help="A built-in generator.")
@click.option(
    "--requests",
    "requests_arg",
    help="With --workload: how many requests (2000). Alone: a request log (one OpenAI request"
    " body a line, as kvindex analyze reads), tokenized with --tokenizer or --tokenizer-url.",
)
@_tokenizer_options
@click.option(
    "--rate",
    type=float,
    help="Arrivals/s (generators: default per workload; a request log: instead of its"
    " timestamps, default 20/s without them).",
)
@click.option("--limit", type=int, help="Read at most this many trace or log requests.")
@click.option("--replicas", default=_SIM.replicas, show_default=True)
@click.option(
    "--capacity-blocks",
    default=_SIM.capacity_blocks,
    show_default=True,
    help="KV-cache blocks per replica.",
)
@click.option("--block-size", default=_SIM.block_size, show_default=True)
@click.option(
    "--prefill-tps",
    default=_SIM.prefill_tps,
    show_default=True,
    help="Prompt tokens/s per replica (serial prefill).",
)
@click.option(
    "--decode-tps", default=_SIM.decode_tps, show_default=True, help="Output tokens/s per request."
)
@click.option(
    "--max-running", default=_SIM.max_running, show_default=True, help="Batch limit per replica."
)
@click.option(
    "--policies",
    "policies",
    default=",".join(DEFAULT_POLICIES),
    show_default=True,
    callback=_policy_list,
    help="Comma-separated; 'oracle' is the reference.",
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
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--via-zmq",
    is_flag=True,
    help="Send events over real ZeroMQ (loopback) to an in-process indexer.",
)
@click.option("--json", "json_path", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="PNG: hit rate and TTFT p90 per policy, hit rate over time.",
)
def simulate(
    trace: Path | None,
    workload: str | None,
    requests_arg: str | None,
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
    **fleet: Any,
) -> None:
    """Replay a trace, a request log or a generated workload through a simulated fleet,
    once per policy."""
    log = None if workload is not None or requests_arg is None else Path(requests_arg)
    if sum(x is not None for x in (trace, workload, log)) != 1:
        raise click.UsageError(
            "give exactly one of --trace FILE, --requests LOG.jsonl or --workload NAME"
        )
    try:
        if trace is not None:
            reqs, source = read_trace(trace, limit=limit), trace.name
        elif log is not None:
            options = _tokenizer_choice(tokenizer_path, chat_template_path, tokenizer_url)
            reqs, source = _logged_requests(log, options, limit, rate, seed), log.name
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
        )
    except KvIndexError as exc:
        raise click.ClickException(str(exc)) from exc


@main.command()
@click.option(
    "--requests",
    "requests_path",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="Request log: one OpenAI request body a line (or {'body': ...}), plain or .gz.",
)
@_tokenizer_options
@click.option("--block-size", default=16, show_default=True, help="Tokens per KV-cache block.")
@click.option("--limit", type=int, help="Read at most this many requests.")
@click.option("--json", "json_path", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="PNG: share of prompt tokens cacheable by position, before and after the fix.",
)
def analyze(
    requests_path: Path,
    tokenizer_path: Path | None,
    chat_template_path: Path | None,
    tokenizer_url: str | None,
    block_size: int,
    limit: int | None,
    json_path: Path | None,
    plot_path: Path | None,
) -> None:
    """What a request log could reuse, what breaks its prefixes, and which policy fits."""
    from kvindex.clients.analyze.run import AnalyzeSettings, analyze_main  # noqa: PLC0415 (numpy)

    try:
        options = _tokenizer_choice(tokenizer_path, chat_template_path, tokenizer_url)
        settings = AnalyzeSettings(options, block_size=block_size, limit=limit)
        analyze_main(
            requests_path,
            settings,
            console=make_console(),
            json_path=json_path,
            plot_path=plot_path,
        )
    except KvIndexError as exc:
        raise click.ClickException(str(exc)) from exc


def _request_count(value: str | None) -> int:
    if value is None:
        return 2000
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
    from kvindex.clients.request_log import read_tokenized_log  # noqa: PLC0415 (tokenizers)

    done, problems = asyncio.run(read_tokenized_log(log, options, limit=limit))
    stderr = make_console(sys.stderr)
    for problem in problems.kept:
        stderr.print(f"{log.name}: skipped {problem}")
    if problems.count > len(problems.kept):
        stderr.print(f"{log.name}: ... and {problems.count - len(problems.kept)} more")
    return logged_trace(done, rate=rate, seed=seed)


register_views(main)  # residency, score, replicas, stats (clients/cli/views.py)
main.add_command(check_hash_command)  # check-hash (clients/cli/check_hash.py)
add_log_options(main)  # every command takes --log-format and --log-level after its name too
