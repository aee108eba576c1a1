"""The indexer's one typed, frozen settings object, read from TOML, env and command line.

Precedence: command line > environment (``KVINDEX_<FIELD>``) > TOML file > defaults.
Every field has a default and a one-line doc (the README's configuration table mirrors
them). :func:`load_settings` validates everything at start and raises
:class:`SettingsError` naming the key and the bad value.

TOML layout::

    store = "redis"
    redis_url = "redis://127.0.0.1:6379/0"

    [[replicas]]
    id = "r1"
    model = "meta-llama/Llama-3.1-8B-Instruct"
    events = "tcp://10.0.0.5:5557"
    replay = "tcp://10.0.0.5:5558"
    url = "http://10.0.0.5:8000"
    dp_size = 1
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args

from kvindex.indexer.errors import KvIndexError
from kvindex.indexer.redis_schema import SchemaError, check_name

StoreKind = Literal["memory", "redis"]
ENV_PREFIX = "KVINDEX_"
API_SECTIONS = ("api", "models")
"""TOML sections of the API process (``kvindex.api.settings``); the indexer skips them."""


class SettingsError(KvIndexError):
    """A setting with a bad value; the message names the key and the value."""


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One vLLM replica (all its data-parallel ranks)."""

    id: str
    """Stable replica id (letters, digits, ``._:-``); the router routes to it."""
    model: str
    """Model name as served (the namespace of its block keys)."""
    events: str | None = None
    """Its PUB endpoint (``--kv-events-config`` ``endpoint``, with the host filled in); the
    indexer connects to it. None when the replica connects to the indexer's bound SUB."""
    replay: str | None = None
    """Its replay ROUTER endpoint (``replay_endpoint``); None disables gap repair."""
    url: str | None = None
    """Base URL of its OpenAI-compatible server (``/metrics``, ``/tokenize``)."""
    dp_size: int = 1
    """Data-parallel ranks; rank r publishes on port + r (PUB and ROUTER)."""

    def __post_init__(self) -> None:
        _check_replica_id(self.id)
        if not self.model:
            raise SettingsError(f"replica {self.id}: model must not be empty")
        if self.dp_size < 1:
            raise SettingsError(f"replica {self.id}: dp_size must be >= 1, got {self.dp_size}")
        for name in ("events", "replay"):
            _check_endpoint(f"replica {self.id}: {name}", getattr(self, name))

    def events_for_rank(self, rank: int) -> str | None:
        """The PUB endpoint of one data-parallel rank (vLLM adds the rank to the port)."""
        return None if self.events is None else endpoint_for_rank(self.events, rank)

    def replay_for_rank(self, rank: int) -> str | None:
        """The replay ROUTER endpoint of one data-parallel rank."""
        return None if self.replay is None else endpoint_for_rank(self.replay, rank)

    @classmethod
    def parse(cls, text: str) -> ReplicaSpec:
        """``id=r1,model=M,events=tcp://h:5557[,replay=...][,url=...][,dp_size=2]``."""
        values: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                raise SettingsError(f"replica {text!r}: expected key=value, got {part!r}")
            values["dp_size" if key == "dp" else key] = value
        return replica_from_mapping(values, where=f"replica {text!r}")


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """vLLM's ``offset_endpoint_port``: tcp port + rank, inproc name + ``_dp<rank>``."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint.rpartition(":")
        if sep and port.isdigit() and int(port) != 0:
            return f"{host}:{int(port) + rank}"
    raise SettingsError(f"cannot derive the endpoint of rank {rank} from {endpoint!r}")


def replica_from_mapping(values: Mapping[str, Any], *, where: str) -> ReplicaSpec:
    known = {f.name for f in fields(ReplicaSpec)}
    unknown = set(values) - known
    if unknown:
        raise SettingsError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(known)})")
    for required in ("id", "model"):
        if not values.get(required):
            raise SettingsError(f"{where}: {required} is required")
    converted = dict(values)
    if "dp_size" in converted:
        converted["dp_size"] = _to_int("dp_size", converted["dp_size"])
    return ReplicaSpec(**converted)


def _check_replica_id(value: str) -> None:
    try:
        check_name("replica id", value)
    except SchemaError as exc:
        raise SettingsError(str(exc)) from exc


def _check_endpoint(name: str, value: str | None) -> None:
    if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise SettingsError(f"{name} must be a ZeroMQ endpoint (tcp://, ipc://), got {value!r}")


@dataclass(frozen=True, slots=True)
class IndexerSettings:
    """Everything an indexer process needs; passed down explicitly, never global."""

    store: StoreKind = "memory"
    """Index store: ``memory`` (in-process, one process) or ``redis`` (shared)."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis URL when ``store = "redis"``."""
    redis_prefix: str = "kvindex"
    """Prefix of every Redis key (several deployments can share one Redis)."""
    bind: str | None = None
    """Bind one SUB here (e.g. ``tcp://0.0.0.0:5557``) for replicas that connect to us;
    each is identified by its topic ``kv@<replica>@<model>`` and registered on first event."""
    default_model: str | None = None
    """Model of a self-registering replica whose topic carries none."""
    replicas: tuple[ReplicaSpec, ...] = ()
    """Replicas to subscribe to (connect mode)."""
    stale_after_s: float = 300.0
    """A replica silent (or disconnected) this long is marked stale."""
    purge_after_s: float = 0.0
    """Drop the blocks of a replica disconnected this long (0 = never)."""
    replay_timeout_s: float = 5.0
    """Give up a replay that has not finished (end marker) after this long."""
    rebuild_cooldown_s: float = 60.0
    """At most one orphan-repair rebuild per stream per this many seconds."""
    reconnect_min_s: float = 0.1
    """First ZeroMQ reconnect back-off."""
    reconnect_max_s: float = 5.0
    """Longest ZeroMQ reconnect back-off."""
    key_cache_size: int = 65_536
    """Recent engine hash → key mappings cached per stream (saves index round trips)."""
    log_level: str = "INFO"
    """Python logging level."""

    def __post_init__(self) -> None:
        if self.store not in get_args(StoreKind):
            raise SettingsError(f"store must be one of {get_args(StoreKind)}, got {self.store!r}")
        try:
            check_name("redis_prefix", self.redis_prefix)
        except SchemaError as exc:
            raise SettingsError(str(exc)) from exc
        _check_endpoint("bind", self.bind)
        for name in ("stale_after_s", "purge_after_s", "replay_timeout_s", "rebuild_cooldown_s"):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        ids = [r.id for r in self.replicas]
        if len(ids) != len(set(ids)):
            raise SettingsError(f"replicas: duplicate ids in {ids}")


_SCALARS = {f.name: f for f in fields(IndexerSettings) if f.name != "replicas"}


def load_settings(
    path: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    extra_replicas: tuple[ReplicaSpec, ...] = (),
) -> IndexerSettings:
    """Defaults < TOML ``path`` < ``KVINDEX_*`` env < ``overrides`` (None values ignored)."""
    values: dict[str, Any] = {}
    replicas: list[ReplicaSpec] = []
    if path is not None:
        file_values = read_toml(path)
        for section in API_SECTIONS:
            file_values.pop(section, None)
        replicas.extend(_replicas_from_toml(file_values.pop("replicas", []), path))
        values.update(_checked(file_values, where=str(path)))
    values.update(_from_env(os.environ if env is None else env))
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    replicas.extend(extra_replicas)
    try:
        return IndexerSettings(**_coerce(values), replicas=tuple(replicas))
    except TypeError as exc:
        raise SettingsError(str(exc)) from exc


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file as a dict; :class:`SettingsError` naming the file when unreadable."""
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise SettingsError(f"config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path}: {exc}") from exc


def _replicas_from_toml(raw: Any, path: Path) -> list[ReplicaSpec]:
    if not isinstance(raw, list):
        raise SettingsError(f"{path}: replicas must be an array of tables ([[replicas]])")
    specs = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise SettingsError(f"{path}: replicas[{i}] must be a table")
        specs.append(replica_from_mapping(item, where=f"{path}: replicas[{i}]"))
    return specs


def _checked(values: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    unknown = set(values) - set(_SCALARS)
    if unknown:
        raise SettingsError(f"{where}: unknown settings {sorted(unknown)}")
    return dict(values)


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    return {
        name: env[ENV_PREFIX + name.upper()]
        for name in _SCALARS
        if ENV_PREFIX + name.upper() in env
    }


def _coerce(values: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in values.items():
        declared = _SCALARS[name].type
        if "float" in str(declared):
            out[name] = _to_float(name, value)
        elif "int" in str(declared):
            out[name] = _to_int(name, value)
        else:
            out[name] = value
    return out


def _to_float(name: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise SettingsError(f"{name} must be a number, got {value!r}") from None


def _to_int(name: str, value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise SettingsError(f"{name} must be an integer, got {value!r}") from None


def replace(settings: IndexerSettings, **changes: Any) -> IndexerSettings:
    """A copy with some fields changed (validated again)."""
    return dataclasses.replace(settings, **changes)
