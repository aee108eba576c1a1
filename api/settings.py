"""The API process's typed settings (TOML ``[api]``, ``[api.weights]``, ``[[models]]``).

Like the indexer's, every field has a default and a one-line doc, the object is frozen and
passed down, and :func:`load_api_settings` raises :class:`SettingsError` naming the key.

TOML::

    [api]
    port = 8000
    default_policy = "kv_aware"

    [api.weights]
    waiting = 0.1

    [[models]]
    name = "meta-llama/Llama-3.1-8B-Instruct"
    block_size = 16
    policy = "kv_aware"
    tokenizer = "/models/llama/tokenizer.json"   # or "replica": ask a replica's /tokenize
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvindex.api.policies import Policy, ScoringError, Weights
from kvindex.api.url_policy import UrlPolicy
from kvindex.indexer.errors import SettingsError


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Per-model routing settings."""

    name: str
    block_size: int | None = None
    """Tokens per KV block; default: as seen in the replicas' events, else the API default."""
    policy: str | None = None
    """Routing policy for this model (a request may still choose its own)."""
    tokenizer: str | None = None
    """Path of a ``tokenizer.json`` (chat template from a sibling ``tokenizer_config.json``),
    or ``replica`` to use a replica's own ``POST /tokenize``."""

    def __post_init__(self) -> None:
        if self.block_size is not None:
            _check_number(f"models.{self.name}.block_size", self.block_size, _POSITIVE_INT)
        if self.policy is not None:
            _check_policy(f"models.{self.name}.policy", self.policy)


@dataclass(frozen=True, slots=True)
class ApiSettings:
    host: str = "127.0.0.1"
    """Listen address."""
    port: int = 8000
    """Listen port."""
    auth_token: str | None = None
    """Bearer token required on every endpoint but /healthz and /readyz (env
    KVINDEX_API_TOKEN)."""
    auth_token_file: str | None = None
    """A file holding the bearer token (env KVINDEX_API_TOKEN_FILE, ``--token-file``); when
    set, its content (stripped) is ``auth_token``, so the token need not be in argv or env."""
    default_policy: str = "kv_aware"
    """Policy when neither the request nor the model's settings choose one."""
    default_block_size: int = 16
    """Block size when the events have not shown one yet (vLLM's default is 16)."""
    weights: Weights = field(default_factory=Weights)
    """Default scoring weights (``[api.weights]``)."""
    models: tuple[ModelSpec, ...] = ()
    """Per-model settings (``[[models]]``)."""
    scrape_interval_s: float = 2.0
    """Scrape every replica's vLLM /metrics this often (0: never; rely on POST /load)."""
    scrape_timeout_s: float = 1.0
    """Timeout of one /metrics or /tokenize call."""
    tokenizer_cache_entries: int = 4096
    """Tokenizations of repeated prompts kept per model."""
    seed: int | None = None
    """Seed of tie-breaks and random policies (tests); None: from the OS."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Largest request body; a larger one (declared or counted) is refused with 413 before
    it is read whole."""
    body_timeout_s: float = 10.0
    """A request body must arrive whole this long after the route starts reading it (408)."""
    replica_networks: tuple[str, ...] = ()
    """Networks (CIDR) a replica URL from ``POST /replicas`` may resolve into; empty: any
    address but a link-local one (169.254.0.0/16, fe80::/10)."""
    redis_timeout_s: float = 0.1
    """Timeout of one Redis call of the API (connect, send, reply): with Redis stopped or
    overloaded, /score answers ``degraded`` this much later than usual, never later."""
    redis_cooldown_s: float = 0.5
    """After a failed Redis call, the API skips Redis this long (answering ``degraded``),
    then lets one call probe it."""

    def __post_init__(self) -> None:
        _check_policy("api.default_policy", self.default_policy)
        _check_number("api.port", self.port, _PORT)
        _check_number("api.default_block_size", self.default_block_size, _POSITIVE_INT)
        _check_number("api.scrape_interval_s", self.scrape_interval_s, _NON_NEGATIVE)
        _check_number("api.scrape_timeout_s", self.scrape_timeout_s, _POSITIVE)
        _check_number("api.tokenizer_cache_entries", self.tokenizer_cache_entries, _COUNT)
        _check_number("api.max_body_bytes", self.max_body_bytes, _POSITIVE_INT)
        _check_number("api.body_timeout_s", self.body_timeout_s, _POSITIVE)
        _check_number("api.redis_timeout_s", self.redis_timeout_s, _POSITIVE)
        _check_number("api.redis_cooldown_s", self.redis_cooldown_s, _POSITIVE)
        names = [m.name for m in self.models]
        if len(names) != len(set(names)):
            raise SettingsError(f"models: duplicate names in {names}")
        self.url_policy()

    def url_policy(self) -> UrlPolicy:
        """The replica URL policy of ``replica_networks`` (SettingsError names a bad one)."""
        networks = self.replica_networks
        if not isinstance(networks, tuple) or not all(isinstance(n, str) for n in networks):
            raise SettingsError(f"api.replica_networks must be a list of CIDRs, got {networks!r}")
        try:
            return UrlPolicy.parse(networks)
        except ValueError as exc:
            raise SettingsError(f"api.replica_networks: {exc}") from None

    def model(self, name: str) -> ModelSpec | None:
        return next((m for m in self.models if m.name == name), None)


@dataclass(frozen=True, slots=True)
class _Range:
    """What a numeric setting accepts, and how to say it in an error."""

    low: float
    high: float
    integer: bool
    low_inclusive: bool
    text: str


_PORT = _Range(0, 65_535, True, True, "an integer in [0, 65535]")
_POSITIVE_INT = _Range(0, math.inf, True, False, "an integer > 0")
_COUNT = _Range(0, math.inf, True, True, "an integer >= 0")
_NON_NEGATIVE = _Range(0, math.inf, False, True, "a finite number >= 0")
_POSITIVE = _Range(0, math.inf, False, False, "a finite number > 0")


def _check_number(key: str, value: object, wanted: _Range) -> None:
    # bool is an int: reject it explicitly, it is never a count or a duration.
    kind = int if wanted.integer else int | float
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value):
        raise SettingsError(f"{key} must be {wanted.text}, got {value!r}")
    above = value >= wanted.low if wanted.low_inclusive else value > wanted.low
    if not (above and value <= wanted.high):
        raise SettingsError(f"{key} must be {wanted.text}, got {value!r}")


def _check_policy(key: str, value: str) -> None:
    try:
        Policy(value)
    except ValueError:
        raise SettingsError(
            f"{key} must be one of {[p.value for p in Policy]}, got {value!r}"
        ) from None


_TOKEN_ENV = {"KVINDEX_API_TOKEN": "auth_token", "KVINDEX_API_TOKEN_FILE": "auth_token_file"}
"""The only API settings read from the environment: the token and its file."""


def load_api_settings(
    values: Mapping[str, Any] | None = None,
    models: list[Mapping[str, Any]] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ApiSettings:
    """From a TOML ``[api]`` table and ``[[models]]`` array, env, then overrides.

    The token comes from ``auth_token`` < ``KVINDEX_API_TOKEN``; a token file named by
    ``auth_token_file`` < ``KVINDEX_API_TOKEN_FILE`` < the ``auth_token_file`` override
    replaces it.
    """
    raw = dict(values or {})
    weights = raw.pop("weights", None)
    known = {f.name for f in fields(ApiSettings)} - {"weights", "models"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise SettingsError(f"[api]: unknown settings {unknown} (known: {sorted(known)})")
    environ = os.environ if env is None else env
    for name, key in _TOKEN_ENV.items():
        if environ.get(name):
            raw[key] = environ[name]
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    if raw.get("auth_token_file") is not None:
        raw["auth_token_file"] = str(raw["auth_token_file"])
        raw["auth_token"] = _read_token(raw["auth_token_file"])
    if isinstance(raw.get("replica_networks"), list):  # TOML arrays are lists
        raw["replica_networks"] = tuple(raw["replica_networks"])
    try:
        return ApiSettings(
            **raw,
            weights=Weights().overridden(weights),
            models=tuple(_model(m) for m in models or []),
        )
    except (TypeError, ScoringError) as exc:
        raise SettingsError(f"[api]: {exc}") from exc


def _read_token(path: str) -> str:
    """The token in a file, surrounding whitespace stripped; SettingsError names the file."""
    try:
        with open(path, encoding="utf-8") as handle:
            token = handle.read().strip()
    except OSError as exc:
        raise SettingsError(f"api.auth_token_file {path}: {exc.strerror}") from None
    if not token:
        raise SettingsError(f"api.auth_token_file {path}: the file is empty")
    return token


def _model(values: Mapping[str, Any]) -> ModelSpec:
    if "name" not in values:
        raise SettingsError("[[models]]: every model needs a name")
    try:
        return ModelSpec(**values)
    except TypeError as exc:
        raise SettingsError(f"[[models]] {values.get('name')}: {exc}") from exc
