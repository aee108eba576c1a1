"""The API process's frozen settings (TOML ``[api]`` and its tables, ``KVINDEX_API_*``),
validated when built: a bad value is a SettingsError naming its key (and variable)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from kvindex.api.config.url_policy import UrlPolicy
from kvindex.api.decision.policies import Policy, ScoringError, Weights
from kvindex.api.decision.routing_rules import RoutingRule, rule_from_table
from kvindex.indexer.config.loading import ConfigFile, from_env_text, layered, read_token
from kvindex.indexer.config.store import StoreSettings
from kvindex.indexer.domain.errors import SettingsError


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Per-model routing settings."""

    name: str
    """The model's name, as requests and the replicas' events give it."""
    block_size: int | None = None
    """Tokens per KV block; default: as seen in the replicas' events, else the API default."""
    policy: str | None = None
    """Routing policy for this model (a request may still choose its own)."""
    tokenizer: str | None = None
    """A ``tokenizer.json`` path (template from its ``tokenizer_config.json``), or a replica's:
    ``replica`` (its render route when served, vLLM's ``--enable-scale-out``, else
    ``/tokenize``), ``render`` or ``tokenize`` (that route only); unset: the model's
    ``tokenizer.json`` in the Hugging Face hub cache (``api.hf_hub_cache``), else ``replica``."""
    loras: tuple[str, ...] = ()
    """LoRA adapters its replicas serve (``--lora-modules``), routed as this model's."""

    def __post_init__(self) -> None:
        loras = self.loras
        if not isinstance(loras, tuple) or not all(isinstance(n, str) and n for n in loras):
            raise SettingsError(f"models.{self.name}.loras must be a list of names, got {loras!r}")
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
    """Bearer token required on all but /healthz and /readyz (also env KVINDEX_API_TOKEN)."""
    auth_token_file: str | None = None
    """A file holding ``auth_token`` (``--token-file``; also env KVINDEX_API_TOKEN_FILE)."""
    default_policy: str = "kv_aware"
    """Policy when neither the request nor the model's settings choose one."""
    default_block_size: int = 16
    """Block size when the events have not shown one yet (vLLM's default is 16)."""
    default_top_k: int = 16
    """Candidates a ``/score`` answer explains when the request sets no ``top_k`` (0: all)."""
    weights: Weights = field(default_factory=Weights)
    """Default scoring weights (``[api.weights]``)."""
    models: tuple[ModelSpec, ...] = ()
    """Per-model settings (``[[models]]``)."""
    rules: tuple[RoutingRule, ...] = ()
    """Routing rules per workload (``[[rules]]``), first match wins."""
    scrape_interval_s: float = 2.0
    """Scrape every replica's vLLM /metrics this often (0: never; rely on POST /load)."""
    scrape_timeout_s: float = 1.0
    """Timeout of one /metrics or /tokenize call."""
    tokenizer_cache_entries: int = 4096
    """Tokenizations of repeated prompts kept per model."""
    tokenizer_cache_bytes: int = 32 * 1024 * 1024
    """Bytes those tokenizations may take per model (4 per token id, the prompt never kept)."""
    tokenizer_prefix_cache_bytes: int = 32 * 1024 * 1024
    """Bytes a local tokenizer keeps per model so a conversation's next turn encodes only its
    new tail: ids of recent texts by the digests of their starts (0: encode every text whole)."""
    hf_hub_cache: str | None = None
    """The Hugging Face hub cache a model with no ``tokenizer`` set is looked up in (read only;
    "": none); default: as ``huggingface_hub`` finds it (``HF_HUB_CACHE``, ``HF_HOME``)."""
    seed: int | None = None
    """Seed of tie-breaks and random policies (tests); None: from the OS."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Largest request body; a larger one is refused with 413 before it is read whole."""
    header_timeout_s: float = 10.0
    """A request head must arrive whole this soon, else the connection is closed unanswered."""
    body_timeout_s: float = 10.0
    """A request body must arrive whole this long after the route starts reading it (408);
    also bounds how long the rest of a refused body is drained before the close."""
    replica_networks: tuple[str, ...] = ()
    """CIDRs a ``POST /replicas`` URL may resolve into; empty: any but link-local."""
    redis_timeout_s: float = 0.1
    """Timeout of one Redis call; with Redis down, /score answers ``degraded`` this late."""
    redis_cooldown_s: float = 0.5
    """After a failed Redis call, skip Redis this long (``degraded``), then probe it."""
    access_log: bool = False
    """Log one line per HTTP request (logger ``kvindex.access``)."""
    health_check_interval_s: float = 1.0
    """Check every replica's ``health_check_path`` this often (0: never), once per fleet."""
    health_check_timeout_s: float = 0.5
    """Timeout of one health check; a timeout is a failure."""
    health_check_path: str = "/health"
    """Path appended to a replica's ``url`` for its health check."""
    health_check_skip_on_traffic: bool = True
    """A proxy or picker does not check a replica that answered one of its requests in the
    round's interval (a pass); false when ``health_check_path`` says more than alive."""
    unhealthy_threshold: int = 2
    """Consecutive failed health checks that eject a replica: a hung one is out within this
    times ``health_check_interval_s`` + ``health_check_timeout_s`` (2.5 s by default)."""
    healthy_threshold: int = 2
    """Consecutive passed health checks that restore an ejected replica."""
    breaker_failures: int = 5
    """Consecutive failed forwards (connect error, 5xx) that open a replica's breaker."""
    breaker_cooldown_s: float = 10.0
    """An open breaker's cool-down; the next answer then closes or reopens it."""
    events_down_after_s: float = 2.0
    """A replica whose events stream is down this long is out of routing (if others aren't)."""
    dynamo_dump: bool = False
    """Serve Dynamo's ``GET /dump`` (``kvindex serve``, memory store): keeps each stored block's
    parent and a hash of its tokens beside the index, and turns the compiled ingest path off."""

    def __post_init__(self) -> None:
        _check_policy("api.default_policy", self.default_policy)
        for name, wanted in _RANGES:
            _check_number(f"api.{name}", getattr(self, name), wanted)
        self._check_health()
        for flag in ("access_log", "dynamo_dump"):
            if not isinstance(getattr(self, flag), bool):
                raise SettingsError(
                    f"api.{flag} must be true or false, got {getattr(self, flag)!r}"
                )
        names = [m.name for m in self.models]
        if len(names) != len(set(names)):
            raise SettingsError(f"models: duplicate names in {names}")
        loras = [lora for m in self.models for lora in m.loras]
        if len(loras) != len(set(loras)) or set(loras) & set(names):
            raise SettingsError(f"models: a LoRA name is a model's or another LoRA's in {loras}")
        rule_names = [r.name for r in self.rules]
        if len(rule_names) != len(set(rule_names)):
            raise SettingsError(f"rules: duplicate names in {rule_names}")
        self.url_policy()

    def _check_health(self) -> None:
        path = self.health_check_path
        if not isinstance(path, str) or not path.startswith("/"):
            raise SettingsError(f"api.health_check_path must start with '/', got {path!r}")

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

    def lora_base(self, name: str) -> str | None:
        """The base model serving the LoRA adapter ``name`` (None: not a declared LoRA)."""
        return next((m.name for m in self.models if name in m.loras), None)


@dataclass(frozen=True, slots=True)
class _Range:
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


# Each numeric [api] key and the values it accepts, checked in this order.
_RANGES: tuple[tuple[str, _Range], ...] = (
    ("port", _PORT),
    ("default_block_size", _POSITIVE_INT),
    ("default_top_k", _COUNT),
    ("scrape_interval_s", _NON_NEGATIVE),
    ("scrape_timeout_s", _POSITIVE),
    ("tokenizer_cache_entries", _COUNT),
    ("tokenizer_cache_bytes", _POSITIVE_INT),
    ("tokenizer_prefix_cache_bytes", _COUNT),
    ("max_body_bytes", _POSITIVE_INT),
    ("body_timeout_s", _POSITIVE),
    ("header_timeout_s", _POSITIVE),
    ("redis_timeout_s", _POSITIVE),
    ("redis_cooldown_s", _POSITIVE),
    ("health_check_interval_s", _NON_NEGATIVE),
    ("health_check_timeout_s", _POSITIVE),
    ("unhealthy_threshold", _POSITIVE_INT),
    ("healthy_threshold", _POSITIVE_INT),
    ("breaker_failures", _POSITIVE_INT),
    ("breaker_cooldown_s", _POSITIVE),
    ("events_down_after_s", _NON_NEGATIVE),
)


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


ENV_PREFIX = "KVINDEX_API_"
"""Field ``f`` is read from ``KVINDEX_API_<F>``, weight ``w`` from ``KVINDEX_API_WEIGHTS_<W>``."""
_ENV_ALIASES = {"KVINDEX_API_TOKEN": "auth_token", "KVINDEX_API_TOKEN_FILE": "auth_token_file"}
"""Older names of ``KVINDEX_API_AUTH_TOKEN[_FILE]``, still read (the longer name wins)."""
_WEIGHTS_ENV = ENV_PREFIX + "WEIGHTS_"


def load_api_settings(
    values: Mapping[str, Any] | None = None,
    models: list[Mapping[str, Any]] | None = None,
    *,
    rules: list[Mapping[str, Any]] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ApiSettings:
    """Defaults < TOML tables < ``KVINDEX_API_*`` env < ``overrides`` (None ignored)."""
    raw = dict(values or {})
    weights = dict(raw.pop("weights", None) or {})
    unknown = sorted(set(raw) - _SCALAR_NAMES)
    if unknown:
        raise SettingsError(f"[api]: unknown settings {unknown} (known: {sorted(_SCALAR_NAMES)})")
    from_env = _ApiEnv.read(os.environ if env is None else env)
    raw = layered(raw, from_env.values, overrides)
    weights.update(from_env.weights)
    if raw.get("auth_token_file") is not None:
        raw["auth_token_file"] = str(raw["auth_token_file"])
        raw["auth_token"] = read_token(raw["auth_token_file"], key="api.auth_token_file")
    if isinstance(raw.get("replica_networks"), list):  # TOML arrays are lists
        raw["replica_networks"] = tuple(raw["replica_networks"])
    model_tables = from_env.models if from_env.models is not None else models
    rule_tables = from_env.rules if from_env.rules is not None else rules
    try:
        return ApiSettings(
            **raw,
            weights=Weights().overridden(weights),
            models=tuple(_model(m) for m in model_tables or []),
            rules=_rules(rule_tables),
        )
    except (TypeError, ScoringError) as exc:
        raise SettingsError(f"[api]: {exc}") from exc
    except SettingsError as exc:
        raise from_env.blamed(exc) from None


_SCALAR_NAMES = {f.name for f in fields(ApiSettings)} - {"weights", "models", "rules"}


@dataclass(slots=True)
class _ApiEnv:
    """What the ``KVINDEX_API_*`` variables set, and which variable set what."""

    values: dict[str, Any] = field(default_factory=dict)
    weights: dict[str, Any] = field(default_factory=dict)
    models: list[Mapping[str, Any]] | None = None
    rules: list[Mapping[str, Any]] | None = None
    key_to_variable: dict[str, str] = field(default_factory=dict)

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> _ApiEnv:
        """Every non-empty ``KVINDEX_API_*`` variable (aliases first: the full names win)."""
        found = cls()
        names = sorted(n for n in environ if n.startswith(ENV_PREFIX) and environ[n])
        for name in sorted(names, key=lambda n: n not in _ENV_ALIASES):
            found._take(name, environ[name])
        return found

    def _take(self, variable: str, text: str) -> None:
        if variable.startswith(_WEIGHTS_ENV):
            weight = variable.removeprefix(_WEIGHTS_ENV).lower()
            kinds = {f.name: str(f.type) for f in fields(Weights)}
            if weight not in kinds:
                raise SettingsError(
                    f"{variable}: no such weight {weight!r} (known: {sorted(kinds)})"
                )
            self.weights[weight] = from_env_text(variable, text, kinds[weight])
            self.key_to_variable[f"weights.{weight}"] = variable
            return
        key = _ENV_ALIASES.get(variable) or variable.removeprefix(ENV_PREFIX).lower()
        if key == "models":
            self.models = _tables_of(variable, text, '[{"name": "m", "block_size": 16}]')
        elif key == "rules":
            example = '[{"name": "batch", "workload": "batch", "policy": "least_load"}]'
            self.rules = _tables_of(variable, text, example)
        elif key in _FIELD_TYPES:
            self.values[key] = from_env_text(variable, text, _FIELD_TYPES[key])
        else:
            tables = ("models", "rules")
            known = [ENV_PREFIX + n.upper() for n in (*sorted(_FIELD_TYPES), *tables)]
            known.append(_WEIGHTS_ENV + "<NAME>")
            raise SettingsError(f"{variable}: no such API setting (known: {known})")
        self.key_to_variable[f"api.{key}"] = variable

    def blamed(self, exc: SettingsError) -> SettingsError:
        text = str(exc)
        for key, variable in self.key_to_variable.items():
            if key in text:
                return SettingsError(f"{text} (set by {variable})")
        return exc


_FIELD_TYPES = {f.name: str(f.type) for f in fields(ApiSettings) if f.name in _SCALAR_NAMES}


def _tables_of(variable: str, text: str, example: str) -> list[Mapping[str, Any]]:
    try:
        tables = json.loads(text)
    except ValueError:
        tables = None
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise SettingsError(
            f"{variable} must be a JSON array of tables (e.g. {example}), got {text!r}"
        )
    return tables


def _model(values: Mapping[str, Any]) -> ModelSpec:
    if "name" not in values:
        raise SettingsError("[[models]]: every model needs a name")
    values = dict(values)
    if isinstance(values.get("loras"), list):  # TOML and JSON arrays are lists
        values["loras"] = tuple(values["loras"])
    try:
        return ModelSpec(**values)
    except TypeError as exc:
        raise SettingsError(f"[[models]] {values.get('name')}: {exc}") from exc


def _rules(tables: Sequence[Mapping[str, Any]] | None) -> tuple[RoutingRule, ...]:
    if tables is not None and not isinstance(tables, list | tuple):
        raise SettingsError(f"rules must be an array of tables ([[rules]]), got {tables!r}")
    try:
        return tuple(rule_from_table(t, i) for i, t in enumerate(tables or (), 1))
    except TypeError as exc:
        raise SettingsError(f"[[rules]]: {exc}") from exc


def api_settings_of(
    file: ConfigFile,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ApiSettings:
    return load_api_settings(
        file.table("api"),
        file.table("models"),
        rules=file.table("rules"),
        env=env,
        overrides=overrides,
    )


@dataclass(frozen=True, slots=True)
class ReadPathSettings:
    """What a read-path process is built from: where its stores are, and the API's own."""

    store: StoreSettings
    api: ApiSettings
