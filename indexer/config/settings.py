"""The indexer's one typed, frozen settings object: command line > ``KVINDEX_<FIELD>`` > TOML
file (replicas as ``[[replicas]]``) > defaults, checked at start; SettingsError names the key."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args

from kvindex.indexer.config.discovery import load_discovery_settings
from kvindex.indexer.config.loading import ConfigFile, layered, read_toml
from kvindex.indexer.config.store import StoreKind, StoreSettings, check_store
from kvindex.indexer.domain.errors import SettingsError
from kvindex.indexer.fleet.replica import ReplicaSpec, check_endpoint, replica_from_mapping
from kvindex.indexer.fleet.settings import DiscoverySettings
from kvindex.indexer.redis.schema import SchemaError, check_name

__all__ = ["IndexerSettings", "StoreKind", "load_settings", "read_toml", "replace"]
ShardMode = Literal["auto", "on", "off"]
SHARD_MODES: tuple[str, ...] = get_args(ShardMode)
ENV_PREFIX = "KVINDEX_"
MAX_AUTO_INGEST_WORKERS = 2  # a third worker finds no compiled ingest left to overlap
MAX_INGEST_WORKERS = 64


@dataclass(frozen=True, slots=True)
class IndexerSettings(StoreSettings):
    """Everything an indexer process needs (the store's keys included), passed down explicitly."""

    bind: str | None = None
    """Bind one SUB here for replicas that connect, registered by topic ``kv@<replica>@<model>``."""
    default_model: str | None = None
    """Model of a self-registering replica whose topic carries none."""
    max_self_registered: int = 1000
    """Most replicas the bound SUB registers from topics; further new topics are refused."""
    replicas: tuple[ReplicaSpec, ...] = ()
    """Replicas to subscribe to (connect mode)."""
    purge_after_s: float = 0.0
    """Drop the blocks of a replica disconnected this long (0 = never)."""
    replay_timeout_s: float = 5.0
    """Give up a replay that has not finished (end marker) after this long."""
    rebuild_cooldown_s: float = 60.0
    """At most one orphan-repair rebuild per stream per this many seconds."""
    probe_interval_s: float = 10.0
    """Replay from a stream's last seq when silent this long, to find a quiet restart (0: off)."""
    store_cooldown_s: float = 1.0
    """After a failed index-store call, skip the store this long, then let one call probe it."""
    reconnect_min_s: float = 0.1
    """First ZeroMQ reconnect back-off."""
    reconnect_max_s: float = 5.0
    """Longest ZeroMQ reconnect back-off."""
    key_cache_size: int = -1
    """Engine hash → key mappings cached per stream (-1: 65,536 on Redis, 0 in memory)."""
    max_open_files: int = 0
    """Soft open-file limit raised to at start, never above the hard one (0: the hard limit)."""
    log_level: str = "INFO"
    """Python logging level."""
    status_host: str = "127.0.0.1"
    """Listen address of the status port (``0.0.0.0``: every interface)."""
    status_port: int = 8090
    """Port of /metrics, /healthz, /readyz (0: any free one, logged; -1: none)."""
    status_probe_s: float = 0.5
    """Seconds between two store probes, whose last answer /readyz reports."""
    status_timeout_s: float = 0.25
    """Socket timeout of the store probe and of the status port's index reads."""
    shard: ShardMode = "auto"
    """Split the streams between indexers on one Redis (``auto``: on with Redis, off in memory)."""
    indexer_id: str = ""
    """This indexer's name among the sharded ones ("": the host name)."""
    lease_ttl_s: float = 10.0
    """A sharded indexer that has not renewed its lease this long loses its streams."""
    ingest_workers: int = 0
    """Memory store's subscriber loops (0: one per two cores, at most 2; Redis: 1 only)."""
    discovery: DiscoverySettings = DiscoverySettings()  # noqa: RUF009 (frozen: one shared value)
    """Replicas read from Kubernetes (the ``[discovery]`` table), beside ``replicas``."""

    @property
    def key_cache_entries(self) -> int:
        if self.key_cache_size >= 0:
            return self.key_cache_size
        return 65_536 if self.store == "redis" else 0

    @property
    def num_ingest_workers(self) -> int:
        if self.ingest_workers > 0:
            return self.ingest_workers
        if self.store == "redis":
            return 1
        return max(1, min(len(os.sched_getaffinity(0)) // 2, MAX_AUTO_INGEST_WORKERS))

    @property
    def sharded(self) -> bool:
        return self.shard == "on" or (self.shard == "auto" and self.store == "redis")

    def __post_init__(self) -> None:
        check_store(self)
        check_endpoint("bind", self.bind)
        _check_shard(self)
        _check_ingest_workers(self)
        if self.key_cache_size < -1:
            raise SettingsError(f"key_cache_size must be >= -1, got {self.key_cache_size!r}")
        if self.max_open_files < 0:
            raise SettingsError(f"max_open_files must be >= 0, got {self.max_open_files!r}")
        if self.max_self_registered < 0:
            raise SettingsError(
                f"max_self_registered must be >= 0, got {self.max_self_registered!r}"
            )
        for name in (
            "purge_after_s",
            "replay_timeout_s",
            "rebuild_cooldown_s",
            "probe_interval_s",
            "store_cooldown_s",
        ):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        _check_status(self)
        ids = [r.id for r in self.replicas]
        if len(ids) != len(set(ids)):
            raise SettingsError(f"replicas: duplicate ids in {ids}")


def _check_shard(settings: IndexerSettings) -> None:
    if settings.shard not in SHARD_MODES:
        raise SettingsError(f"shard must be one of {SHARD_MODES}, got {settings.shard!r}")
    if settings.shard == "on" and settings.store != "redis":
        raise SettingsError('shard = "on" needs store = "redis" (indexers share one store)')
    if not settings.lease_ttl_s > 0:
        raise SettingsError(f"lease_ttl_s must be > 0, got {settings.lease_ttl_s!r}")
    if settings.indexer_id:
        try:
            check_name("indexer_id", settings.indexer_id)
        except SchemaError as exc:
            raise SettingsError(str(exc)) from exc


def _check_ingest_workers(settings: IndexerSettings) -> None:
    if not 0 <= settings.ingest_workers <= MAX_INGEST_WORKERS:
        raise SettingsError(
            f"ingest_workers must be 0 (one per core) to {MAX_INGEST_WORKERS},"
            f" got {settings.ingest_workers!r}"
        )
    if settings.ingest_workers > 1 and settings.store == "redis":
        raise SettingsError(
            f"ingest_workers = {settings.ingest_workers} is for the memory store; on Redis"
            " run more `kvindex indexer` processes (they split the streams)"
        )


def _check_status(settings: IndexerSettings) -> None:
    if not -1 <= settings.status_port <= 65535:
        raise SettingsError(
            f"status_port must be -1 (off), 0 (any) or a port, got {settings.status_port!r}"
        )
    for name in ("status_probe_s", "status_timeout_s"):
        if not getattr(settings, name) > 0:
            raise SettingsError(f"{name} must be > 0, got {getattr(settings, name)!r}")


_SCALARS = {f.name: f for f in fields(IndexerSettings) if f.name not in ("replicas", "discovery")}
_STORE_KEYS = frozenset(f.name for f in fields(StoreSettings))


def load_settings(
    source: Path | ConfigFile | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    extra_replicas: tuple[ReplicaSpec, ...] = (),
    discovery: Mapping[str, Any] | None = None,
) -> IndexerSettings:
    """``discovery``: the ``[discovery]`` keys the command line sets (None values ignored)."""
    file = source if isinstance(source, ConfigFile) else ConfigFile.read(source)
    file_values = _checked(file)
    replicas = _replicas_from_toml(file_values.pop("replicas", []), file.path)
    environ = os.environ if env is None else env
    values = layered(file_values, _from_env(environ), overrides)
    found = load_discovery_settings(file.table("discovery"), env=environ, overrides=discovery)
    try:
        return IndexerSettings(
            **_coerce(values), replicas=(*replicas, *extra_replicas), discovery=found
        )
    except TypeError as exc:
        raise SettingsError(str(exc)) from exc


def load_store_settings(
    source: Path | ConfigFile | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> StoreSettings:
    file = source if isinstance(source, ConfigFile) else ConfigFile.read(source)
    file_values = {k: v for k, v in _checked(file).items() if k in _STORE_KEYS}
    env_values = _from_env(os.environ if env is None else env)
    values = layered(
        file_values, {k: v for k, v in env_values.items() if k in _STORE_KEYS}, overrides
    )
    try:
        return StoreSettings(**_coerce(values))
    except TypeError as exc:
        raise SettingsError(str(exc)) from exc


def _replicas_from_toml(raw: Any, path: Path | None) -> list[ReplicaSpec]:
    if not isinstance(raw, list):
        raise SettingsError(f"{path}: replicas must be an array of tables ([[replicas]])")
    specs = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise SettingsError(f"{path}: replicas[{i}] must be a table")
        specs.append(replica_from_mapping(item, where=f"{path}: replicas[{i}]"))
    return specs


def _checked(file: ConfigFile) -> dict[str, Any]:
    values = file.top_level()
    unknown = set(values) - set(_SCALARS) - {"replicas"}
    if unknown:
        raise SettingsError(f"{file.path}: unknown settings {sorted(unknown)}")
    return values


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
    return dataclasses.replace(settings, **changes)
