"""The proxy's frozen settings (TOML ``[proxy]``, ``KVINDEX_PROXY_*``), validated when built:
a bad value is a SettingsError naming its ``proxy.*`` key (and the variable that set it)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvindex.clients.proxy.routes import is_plain_route
from kvindex.indexer.config.loading import ConfigFile, from_env_text, layered, read_token
from kvindex.indexer.domain.errors import SettingsError


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """How the proxy forwards."""

    connect_timeout_s: float = 2.0
    """Longest wait for a connection to a replica; past it the next replica is tried."""
    first_byte_timeout_s: float = 300.0
    """Longest wait for an answer's head (a whole generation when not streamed); then 504."""
    stream_idle_timeout_s: float = 120.0
    """Longest gap between two chunks of an answer's body; past it the body ends early."""
    total_timeout_s: float = 900.0
    """Longest time one request may take, attempts and stream included."""
    max_attempts: int = 3
    """Replicas tried at most per request (1: no retry), each a different one."""
    retry_backoff_s: float = 0.02
    """Wait before the second attempt, doubled for each next one, jittered (0: at once)."""
    retry_backoff_max_s: float = 0.5
    """Longest wait between two attempts."""
    max_connections: int = 1024
    """Connections to one replica at once (its HTTP client's pool)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM or SIGINT, how long the requests being answered may finish (whole seconds)."""
    lease_ttl_s: float = 10.0
    """Life of this proxy's lease on its requests in flight, renewed every third of it."""
    auth_token: str | None = field(default=None, repr=False)
    """Bearer token a client must send on all but ``/health``, ``/healthz``, ``/readyz``."""
    auth_token_file: str | None = None
    """A file holding ``auth_token`` (``--token-file``); it wins over a token given otherwise."""
    upstream_api_key: str | None = field(default=None, repr=False)
    """Sent to replicas as the bearer token (vLLM's ``--api-key``); None: no key is sent."""
    replica_api_keys: dict[str, str] = field(default_factory=dict, repr=False)
    """Replica id → the key sent to that replica, over ``upstream_api_key``."""
    forward_client_authorization: bool = False
    """Send a client's own ``Authorization`` to replicas without a key (never with auth_token)."""
    extra_routes: tuple[str, ...] = ()
    """More paths passed through to replicas (e.g. ``/v1/load_lora_adapter``, ``/tokenize``)."""
    port: int = 8080
    """Port the proxy listens on (its own default: the API's 8000 may run beside it)."""
    workers: int = 1
    """Processes serving the port, each with its own read path and connections (memory
    store: each its own subscriber and index; Redis: one shared index and load)."""
    hang_silence_s: float = 1.0
    """A replica owing answers that sends no byte this long gets a health probe; failing it
    ejects it and sends its waiting requests elsewhere (at most 1.5 times this + the check's
    timeout after they were sent: 2 s by default)."""
    verdict_window: int = 10
    """A replica's last compared requests (exact, over- or under-predicted) judged together."""
    over_predicted_limit: int = 3
    """Over-predictions among them that drop the replica's blocks and discount its cache."""
    exact_to_trust: int = 5
    """Exact predictions since its last over-prediction that lift a replica's discount."""
    journal_entries: int = 4096
    """Receipts of routed requests kept in memory, newest (``GET /decisions``); 0: none made."""
    journal_candidates: int = 4
    """Candidates a receipt explains (the best first, as ``/score`` explains them)."""
    journal_stream_maxlen: int = 100_000
    """On the Redis store, the shared Stream of receipts is trimmed to about this many (0: none)."""
    journal_token_bytes: int = 0
    """A receipt keeps its prompt's leading token ids, at most this many bytes (4 an id), for
    ``kvindex simulate --requests``; 0: none (the ids are the prompt: keep them knowingly)."""
    head_first: bool = True
    """A long prompt no replica holds the start of is chosen for on its head (local tokenizers),
    the rest tokenized while the replica answers; false: every prompt tokenized whole first."""

    def __post_init__(self) -> None:
        _check_numbers(self)
        _check_credentials(self)
        _check_routes(self)

    def api_key_of(self, replica: str) -> str | None:
        """The key sent to ``replica`` (None: no ``Authorization``, or the client's if told)."""
        return self.replica_api_keys.get(replica, self.upstream_api_key)


_POSITIVE = (
    "connect_timeout_s",
    "first_byte_timeout_s",
    "stream_idle_timeout_s",
    "total_timeout_s",
    "drain_timeout_s",
    "retry_backoff_max_s",
    "lease_ttl_s",
    "hang_silence_s",
)

_JOURNAL = (
    "journal_entries",
    "journal_candidates",
    "journal_stream_maxlen",
    "journal_token_bytes",
)


def _check_numbers(settings: ProxySettings) -> None:
    for name in (*_POSITIVE, "retry_backoff_s"):
        value = getattr(settings, name)
        low_ok = name == "retry_backoff_s"
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SettingsError(f"proxy.{name} must be a number, got {value!r}")
        if not (value >= 0 if low_ok else value > 0) or value == float("inf"):
            wanted = "a finite number >= 0" if low_ok else "a finite number > 0"
            raise SettingsError(f"proxy.{name} must be {wanted}, got {value!r}")
    whole = ("verdict_window", "over_predicted_limit", "exact_to_trust")
    for name in ("max_attempts", "max_connections", "port", "workers", *whole):
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SettingsError(f"proxy.{name} must be an integer >= 1, got {value!r}")
    for name in _JOURNAL:
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SettingsError(f"proxy.{name} must be an integer >= 0, got {value!r}")
    if settings.port > 65535:
        raise SettingsError(f"proxy.port must be at most 65535, got {settings.port!r}")
    if settings.over_predicted_limit > settings.verdict_window:
        raise SettingsError(
            f"proxy.over_predicted_limit ({settings.over_predicted_limit}) must be at most"
            f" proxy.verdict_window ({settings.verdict_window})"
        )


def _check_credentials(settings: ProxySettings) -> None:
    for name in ("auth_token", "auth_token_file", "upstream_api_key"):
        value = getattr(settings, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise SettingsError(f"proxy.{name} must be a non-empty string")
    keys = settings.replica_api_keys
    if not isinstance(keys, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v for k, v in keys.items()
    ):
        raise SettingsError(
            "proxy.replica_api_keys must be a table of replica id = non-empty string"
        )
    for name in ("forward_client_authorization", "head_first"):
        if not isinstance(getattr(settings, name), bool):
            raise SettingsError(f"proxy.{name} must be true or false")
    if settings.forward_client_authorization and settings.auth_token is not None:
        raise SettingsError(
            "proxy.forward_client_authorization would send the proxy's own auth_token on:"
            " give replicas upstream_api_key instead"
        )


def _check_routes(settings: ProxySettings) -> None:
    routes = settings.extra_routes
    if isinstance(routes, list):
        routes = tuple(routes)
        object.__setattr__(settings, "extra_routes", routes)
    if not isinstance(routes, tuple):
        raise SettingsError(f"proxy.extra_routes must be a list of paths, got {routes!r}")
    for route in routes:
        if not isinstance(route, str) or not is_plain_route(route):
            raise SettingsError(
                f"proxy.extra_routes: {route!r} is not a plain path (no dot segments)"
                " of a route the proxy does not answer itself"
            )


ENV_PREFIX = "KVINDEX_PROXY_"
"""Every ProxySettings field ``f`` is read from ``KVINDEX_PROXY_<F>``."""
_FIELD_TYPES = {f.name: str(f.type) for f in fields(ProxySettings)}
_SECRETS = frozenset({"auth_token", "upstream_api_key", "replica_api_keys"})


def load_proxy_settings(
    values: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ProxySettings:
    """Defaults < TOML ``[proxy]`` < ``KVINDEX_PROXY_*`` env < ``overrides`` (None ignored)."""
    if values is not None and not isinstance(values, Mapping):
        raise SettingsError(f"[proxy] must be a table, got {values!r}")
    raw = dict(values or {})
    unknown = sorted(set(raw) - set(_FIELD_TYPES))
    if unknown:
        raise SettingsError(f"[proxy]: unknown settings {unknown} (known: {sorted(_FIELD_TYPES)})")
    from_env = _from_env(os.environ if env is None else env)
    raw = layered(raw, from_env, overrides)
    if raw.get("auth_token_file") is not None:
        raw["auth_token_file"] = str(raw["auth_token_file"])
        raw["auth_token"] = read_token(raw["auth_token_file"], key="proxy.auth_token_file")
    try:
        return ProxySettings(**raw)
    except SettingsError as exc:
        blamed = [v for k, v in _env_names(from_env).items() if f"proxy.{k} " in f"{exc} "]
        raise SettingsError(f"{exc} (set by {blamed[0]})" if blamed else str(exc)) from None


def _env_names(values: Mapping[str, Any]) -> dict[str, str]:
    return {key: ENV_PREFIX + key.upper() for key in values}


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for variable in sorted(n for n in environ if n.startswith(ENV_PREFIX) and environ[n]):
        key = variable.removeprefix(ENV_PREFIX).lower()
        text = environ[variable]
        if key not in _FIELD_TYPES:
            known = [ENV_PREFIX + n.upper() for n in sorted(_FIELD_TYPES)]
            raise SettingsError(f"{variable}: no such proxy setting (known: {known})")
        if key == "replica_api_keys":
            found[key] = _api_keys_of(variable, text)
        elif key in _SECRETS:
            found[key] = text
        else:
            found[key] = from_env_text(variable, text, _FIELD_TYPES[key])
    return found


def _api_keys_of(variable: str, text: str) -> dict[str, str]:
    try:
        keys = json.loads(text)
    except ValueError:
        keys = None
    if not isinstance(keys, dict):
        raise SettingsError(f'{variable} must be a JSON object (e.g. {{"r1": "key"}})')
    return keys


def proxy_settings_of(
    file: ConfigFile,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ProxySettings:
    return load_proxy_settings(file.table("proxy"), env=env, overrides=overrides)
