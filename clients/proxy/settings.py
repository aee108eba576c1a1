"""The proxy's typed settings: the ``[proxy]`` table of the config file."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvindex.indexer.config.loading import ConfigFile, from_env_text, layered, read_token
from kvindex.indexer.domain.errors import SettingsError


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """How the proxy forwards; every field defaulted, validated on construction (errors
    name the ``proxy.*`` key and the bad value)."""

    connect_timeout_s: float = 2.0
    """Longest wait for a connection to a replica; past it the next replica is tried."""
    first_byte_timeout_s: float = 300.0
    """Longest wait for a replica's answer to start (its status line and headers; a
    non-streaming vLLM answer starts when generation ends, so keep it generous). Past it
    the request ends with 504."""
    stream_idle_timeout_s: float = 120.0
    """Longest gap between two chunks of an answer's body once it has started (a stream
    whose replica hangs); past it the body ends early (the client sees it incomplete)."""
    total_timeout_s: float = 900.0
    """Longest time one request may take, attempts and stream included; a stream cut by
    it ends early (the client sees an incomplete body)."""
    max_attempts: int = 3
    """Replicas tried at most per request (1: no retry), each a different one."""
    retry_backoff_s: float = 0.02
    """Wait before the second attempt; doubled before each further one, capped by
    ``retry_backoff_max_s``, and jittered (drawn uniformly between half of it and all of
    it). 0: retry at once."""
    retry_backoff_max_s: float = 0.5
    """Longest wait between two attempts."""
    max_connections: int = 1024
    """Connections to one replica at once (its HTTP client's pool)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM or SIGINT the proxy stops accepting connections and lets the requests it
    is answering (streams included) finish for at most this long (rounded up to whole
    seconds), then stops."""
    lease_ttl_s: float = 10.0
    """Life of this proxy's lease on its requests in flight (reserved in the load store),
    renewed every third of it while the proxy lives: a proxy killed without a goodbye
    stops counting as load this long after its last renewal."""
    auth_token: str | None = field(default=None, repr=False)
    """Bearer token a client must send (``Authorization: Bearer <token>``) on every route
    but ``/health``, ``/healthz`` and ``/readyz`` (401 otherwise); None: no token asked."""
    auth_token_file: str | None = None
    """A file holding ``auth_token`` (stripped; ``--token-file``): when set it replaces
    any token given otherwise, so the token need not be in argv, env or the file."""
    upstream_api_key: str | None = field(default=None, repr=False)
    """Sent to every replica as ``Authorization: Bearer <key>`` in place of the client's
    header (vLLM's ``--api-key``); None: the client's ``Authorization`` passes through."""
    replica_api_keys: dict[str, str] = field(default_factory=dict, repr=False)
    """Replica id → the key sent to that replica, over ``upstream_api_key``."""
    port: int = 8080
    """Port the proxy listens on (its own default: the API's 8000 may run beside it)."""

    def __post_init__(self) -> None:
        _check_numbers(self)
        for name in ("auth_token", "auth_token_file", "upstream_api_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SettingsError(f"proxy.{name} must be a non-empty string")
        keys = self.replica_api_keys
        if not isinstance(keys, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and v for k, v in keys.items()
        ):
            raise SettingsError(
                "proxy.replica_api_keys must be a table of replica id = non-empty string"
            )

    def api_key_of(self, replica: str) -> str | None:
        """The key sent to ``replica`` (None: the client's ``Authorization`` is kept)."""
        return self.replica_api_keys.get(replica, self.upstream_api_key)


_POSITIVE = (
    "connect_timeout_s",
    "first_byte_timeout_s",
    "stream_idle_timeout_s",
    "total_timeout_s",
    "drain_timeout_s",
    "retry_backoff_max_s",
    "lease_ttl_s",
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
    for name in ("max_attempts", "max_connections", "port"):
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SettingsError(f"proxy.{name} must be an integer >= 1, got {value!r}")
    if settings.port > 65535:
        raise SettingsError(f"proxy.port must be at most 65535, got {settings.port!r}")


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
    """Defaults < a TOML ``[proxy]`` table < ``KVINDEX_PROXY_*`` env < ``overrides`` (None
    values ignored)."""
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
    """Every non-empty ``KVINDEX_PROXY_*`` variable, coerced to its field's type."""
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
    """:func:`load_proxy_settings` of the file's ``[proxy]``."""
    return load_proxy_settings(file.table("proxy"), env=env, overrides=overrides)
