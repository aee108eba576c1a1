"""The ``kvindex`` command line: a thin shell over the library.

Each command imports what it runs, so that ``kvindex --version`` and the views start quickly."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvindex.clients.cli.check_hash import check_hash_command
from kvindex.clients.cli.log_format import add_log_options, apply_log_options, log_options
from kvindex.clients.cli.offline import register_offline
from kvindex.clients.cli.process import check_port, run_indexer, say, stop_event
from kvindex.clients.cli.views import register_views
from kvindex.clients.cli.why import why as why_command
from kvindex.indexer.domain.errors import KvIndexError

if TYPE_CHECKING:  # imported where used: a command loads only what it runs
    from kvindex.indexer.fleet.replica import ReplicaSpec


def _replica_option(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> Any:
    from kvindex.indexer.fleet.replica import ReplicaSpec

    try:
        return tuple(ReplicaSpec.parse(v) for v in values)
    except KvIndexError as exc:
        raise click.BadParameter(str(exc)) from exc


Decorator = Callable[[Callable[..., None]], Callable[..., None]]


def _indexer_options(command: Callable[..., None]) -> Callable[..., None]:
    """The write-path options every process that runs an indexer takes."""
    options: list[Decorator] = [
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
        *_discovery_options(),
    ]
    folded = _fold_discovery(command)
    for option in reversed(options):
        folded = option(folded)
    return folded


_DISCOVERY_KEYS = (
    ("k8s_pool", "pool"),
    ("k8s_selector", "selector"),
    ("k8s_ports", "ports"),
    ("k8s_namespace", "namespace"),
    ("k8s_model", "model"),
    ("kubeconfig", "kubeconfig"),
)


def _discovery_options() -> list[Decorator]:
    """The ``[discovery]`` keys on the command line (docs/kubernetes.md, "Discovery")."""
    return [
        click.option("--k8s-pool", help="Replicas: the pods of this InferencePool (Kubernetes)."),
        click.option(
            "--k8s-selector",
            help="Replicas: the pods with these labels (app=vllm), with --k8s-port.",
        ),
        click.option(
            "--k8s-port",
            "k8s_ports",
            type=click.IntRange(1, 65535),
            multiple=True,
            help="With --k8s-selector: a serving port of each pod, one per DP rank (repeatable).",
        ),
        click.option(
            "--k8s-namespace", help="Namespace of the pool and pods (default: this pod's own)."
        ),
        click.option("--k8s-model", help="Model of a pod without a kvindex.io/model annotation."),
        click.option(
            "--kubeconfig",
            type=click.Path(dir_okay=False),
            help="Kubeconfig file (default: the service account in a pod, else ~/.kube/config).",
        ),
    ]


def _fold_discovery(command: Callable[..., None]) -> Callable[..., None]:
    """``command`` taking the discovery options as one ``discovery`` mapping (None: unset)."""

    @functools.wraps(command)
    def folded(**kwargs: Any) -> None:
        found = {key: kwargs.pop(name) for name, key in _DISCOVERY_KEYS}
        found["ports"] = found["ports"] or None  # a repeatable option gives () when absent
        command(discovery=found, **kwargs)

    return folded


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
    discovery: dict[str, Any],
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
    from kvindex.indexer.config.settings import load_settings

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
            discovery=discovery,
        )
    except KvIndexError as exc:
        raise click.ClickException(str(exc)) from exc
    run_indexer(settings, stats_every)


def _api_overrides(
    host: str | None, port: int | None, token_file: Path | None, access_log: bool | None
) -> dict[str, Any]:
    """The ``[api]`` keys ``serve`` and ``api`` take on their command line."""
    return {"host": host, "port": port, "auth_token_file": token_file, "access_log": access_log}


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
    discovery: dict[str, Any],
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
    from kvindex.api.config.settings import api_settings_of
    from kvindex.api.http.server import serve as run_server
    from kvindex.clients.cli.status import StatusLog, fleet_status
    from kvindex.indexer.config.loading import ConfigFile
    from kvindex.indexer.config.settings import load_settings

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
            discovery=discovery,
        )
        api = api_settings_of(file, overrides=_api_overrides(host, port, token_file, access_log))
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
    from kvindex.api.config.settings import ReadPathSettings, api_settings_of
    from kvindex.api.http.server import serve_api
    from kvindex.indexer.config.loading import ConfigFile
    from kvindex.indexer.config.settings import load_store_settings

    try:
        file = ConfigFile.read(config)
        store = load_store_settings(file, overrides={"store": "redis", "redis_url": redis_url})
        api_settings = api_settings_of(
            file, overrides=_api_overrides(host, port, token_file, access_log)
        )
    except KvIndexError as exc:
        raise click.ClickException(str(exc)) from exc
    check_port(api_settings.host, api_settings.port)
    where = f"http://{api_settings.host}:{api_settings.port}"
    say(f"kvindex api (redis fleet, index and load) on {where}")
    try:
        serve_api(ReadPathSettings(store, api_settings))
    except KvIndexError as exc:  # e.g. an index this version does not read
        raise click.ClickException(str(exc)) from exc


@main.command()
@_indexer_options
@click.option("--host", help="Proxy listen address (default 127.0.0.1).")
@click.option(
    "--port", type=int, help="Proxy listen port (else env KVINDEX_PROXY_PORT, [proxy]; 8080)."
)
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
@click.option("--retry-backoff-s", type=float, help="Wait before the second attempt (0.02).")
@click.option("--retry-backoff-max-s", type=float, help="Longest wait between attempts (0.5).")
@click.option("--max-connections", type=int, help="Connections to one replica at once (1024).")
@click.option("--workers", type=int, help="Processes serving the port, each its own read path (1).")
@click.option(
    "--forward-client-authorization/--no-forward-client-authorization",
    default=None,
    help="Send a client's own Authorization to replicas that have no key (default: never).",
)
@click.option(
    "--extra-route",
    "extra_routes",
    multiple=True,
    help="Another /v1/... path passed through to replicas (repeatable; else [proxy]).",
)
@click.option(
    "--access-log/--no-access-log",
    default=None,
    help="Log one line per OpenAI request: id, route, replica, status, time to first byte,"
    " duration, matched fraction, retries (else env KVINDEX_API_ACCESS_LOG,"
    " [api] access_log; default off).",
)
def proxy(
    discovery: dict[str, Any],
    config: Path | None,
    replicas: tuple[ReplicaSpec, ...],
    bind: str | None,
    store: str | None,
    redis_url: str | None,
    host: str | None,
    port: int | None,
    extra_routes: tuple[str, ...],
    access_log: bool | None,
    **forwarding: Any,
) -> None:
    """Serve the OpenAI API and forward each request to the replica kvindex picks.

    Settings: [proxy] of --config < env KVINDEX_PROXY_<NAME> < these options; the keys
    given to replicas (upstream_api_key, replica_api_keys) only by env or file."""
    from kvindex.api.config.settings import api_settings_of
    from kvindex.clients.proxy.service import serve_proxy
    from kvindex.clients.proxy.settings import proxy_settings_of
    from kvindex.indexer.config.loading import ConfigFile
    from kvindex.indexer.config.settings import load_settings

    try:
        file = ConfigFile.read(config)
        settings = load_settings(
            file,
            overrides={"bind": bind, "store": store, "redis_url": redis_url},
            extra_replicas=replicas,
            discovery=discovery,
        )
        routes = extra_routes or None  # none given: the file's or the env's
        overrides = {**forwarding, "port": port, "extra_routes": routes}
        proxy_settings = proxy_settings_of(file, overrides=overrides)
        listen = {"host": host, "port": proxy_settings.port, "access_log": access_log}
        api_settings = api_settings_of(file, overrides=listen)
    except KvIndexError as exc:
        raise click.ClickException(str(exc)) from exc
    check_port(api_settings.host, api_settings.port)
    where = f"http://{api_settings.host}:{api_settings.port}"
    say(f"kvindex proxy ({settings.store} store) on {where}/v1")
    try:
        serve_proxy(settings, api_settings, proxy_settings)
    except KvIndexError as exc:  # e.g. an index this version does not read
        raise click.ClickException(str(exc)) from exc


@main.command()
@_indexer_options
@click.option("--host", help="Listen address of both ports (default: [api] host, 127.0.0.1).")
@click.option("--port", type=int, help="gRPC port (else env KVINDEX_PICKER_PORT, [picker]; 9002).")
@click.option(
    "--metrics-port", type=int, help="/metrics, /healthz, /readyz port (9090; 0: any; -1: none)."
)
def picker(
    discovery: dict[str, Any],
    config: Path | None,
    replicas: tuple[ReplicaSpec, ...],
    bind: str | None,
    store: str | None,
    redis_url: str | None,
    host: str | None,
    port: int | None,
    metrics_port: int | None,
) -> None:
    """Serve a Gateway API Inference Extension endpoint picker (Envoy ext_proc over gRPC).

    Settings: [picker] of --config < env KVINDEX_PICKER_<NAME> < these options."""
    from kvindex.api.config.settings import api_settings_of
    from kvindex.clients.picker.service import serve_picker
    from kvindex.clients.picker.settings import picker_settings_of
    from kvindex.indexer.config.loading import ConfigFile
    from kvindex.indexer.config.settings import load_settings

    try:
        file = ConfigFile.read(config)
        overrides = {"bind": bind, "store": store, "redis_url": redis_url}
        settings = load_settings(
            file, overrides=overrides, extra_replicas=replicas, discovery=discovery
        )
        ports = {"port": port, "metrics_port": metrics_port}
        picker_settings = picker_settings_of(file, overrides=ports)
        api_settings = api_settings_of(file, overrides={"host": host})
    except KvIndexError as exc:
        raise click.ClickException(str(exc)) from exc
    for listen in (picker_settings.port, picker_settings.metrics_port):
        if listen > 0:
            check_port(api_settings.host, listen)
    say(f"kvindex picker ({settings.store} store) on {api_settings.host}:{picker_settings.port}")
    try:
        serve_picker(settings, api_settings, picker_settings)
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
@click.option(
    "--encoding",
    type=click.Choice(["map", "array"]),
    default="map",
    show_default=True,
    help="Event encoding: map (vLLM 0.24 and later) or array (0.23 and before).",
)
@click.option(
    "--replay-layout",
    type=click.Choice(["topic", "legacy"]),
    default="topic",
    show_default=True,
    help="Replay frames: topic (vLLM 0.26 and later) or legacy.",
)
@click.option("--block-size", default=16, show_default=True, help="Tokens per KV-cache block.")
@click.option(
    "--capacity-blocks", default=1024, show_default=True, help="KV-cache blocks the replica holds."
)
@click.option("--prefill-tps", default=8000.0, show_default=True, help="Prompt tokens/s.")
@click.option("--decode-tps", default=50.0, show_default=True, help="Output tokens/s a request.")
@click.option("--max-running", default=8, show_default=True, help="Requests run at once.")
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
    "--enable-scale-out",
    is_flag=True,
    help="Serve the render routes /v1/completions/render and /v1/chat/completions/render"
    " (vLLM's --enable-scale-out).",
)
@click.option(
    "--stream-stall-s",
    default=0.0,
    show_default=True,
    help="Test knob: stall each stream this long after its first chunk (0: never).",
)
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, dir_okay=False),
    help="Tokenize with this tokenizer.json, as vLLM with the model's (default: a toy one).",
)
@click.option(
    "--chat-template",
    type=click.Path(exists=True, dir_okay=False),
    help="The chat template of --tokenizer (default: beside it, as Hugging Face lays it out).",
)
@click.option(
    "--enable-prompt-tokens-details/--disable-prompt-tokens-details",
    default=True,
    show_default=True,
    help="Report usage.prompt_tokens_details.cached_tokens, as vLLM with this flag.",
)
@click.option(
    "--lie",
    "lies",
    multiple=True,
    help="Test knob: lie as real fleets go wrong (repeatable): drop-removals,"
    " events-off-restart[=N], block-size=N, tokenizer[=N].",
)
def replica_sim(
    replica_id: str, bind_events: bool, lora_names: tuple[str, ...], replay: str, **kw: Any
) -> None:
    """Run a simulated vLLM replica (HTTP API and KV events) until SIGINT or SIGTERM."""
    from kvindex.clients.fake_vllm import replica

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


register_views(main)  # residency, score, replicas, stats (clients/cli/views.py)
register_offline(main)  # demo, simulate, analyze (clients/cli/offline.py)
main.add_command(check_hash_command)  # check-hash (clients/cli/check_hash.py)
main.add_command(why_command)  # why (clients/cli/why.py)
add_log_options(main)  # every command takes --log-format and --log-level after its name too
