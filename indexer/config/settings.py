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
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args

from kvindex.indexer.config.loading import ConfigFile, layered, read_toml
from kvindex.indexer.config.store import StoreKind, StoreSettings, check_store
from kvindex.indexer.domain.errors import SettingsError
from kvindex.indexer.fleet.replica import ReplicaSpec, check_endpoint, replica_from_mapping
from kvindex.indexer.redis.schema import SchemaError, check_name

__all__ = ["IndexerSettings", "StoreKind", "load_settings", "read_toml", "replace"]
ShardMode = Literal["auto", "on", "off"]
SHARD_MODES: tuple[str, ...] = get_args(ShardMode)
ENV_PREFIX = "KVINDEX_"
MAX_AUTO_INGEST_WORKERS = 2
"""Most ingest workers ``ingest_workers = 0`` starts. What two workers can overlap is one's
compiled ingest (without the GIL, under the index lock) with the other's receiving and
decoding (under the GIL): the smaller of the two is a quarter to a third of a worker's
time, so a third worker finds nothing left to overlap."""
MAX_INGEST_WORKERS = 64
"""Most ingest workers a setting may ask for."""


@dataclass(frozen=True, slots=True)
class IndexerSettings(StoreSettings):
    """Everything an indexer process needs (the store's keys included); passed down
    explicitly, never global."""

    bind: str | None = None
    """Bind one SUB here (e.g. ``tcp://10.0.0.2:5557``) for replicas that connect to us;
    each is identified by its topic ``kv@<replica>@<model>`` and registered on first event."""
    default_model: str | None = None
    """Model of a self-registering replica whose topic carries none."""
    max_self_registered: int = 1000
    """Most replicas the bound SUB registers from topics; further new topics are refused
    and counted (``unrouted.num_refused``)."""
    replicas: tuple[ReplicaSpec, ...] = ()
    """Replicas to subscribe to (connect mode)."""
    purge_after_s: float = 0.0
    """Drop the blocks of a replica disconnected this long (0 = never)."""
    replay_timeout_s: float = 5.0
    """Give up a replay that has not finished (end marker) after this long."""
    rebuild_cooldown_s: float = 60.0
    """At most one orphan-repair rebuild per stream per this many seconds."""
    probe_interval_s: float = 10.0
    """Probe a stream with a replay endpoint that has been silent this long (a replay from
    its last applied seq): a replica restarted quiet is then found and its old blocks
    dropped within this interval plus two replays (``replay_timeout_s`` at worst). 0 = off."""
    store_cooldown_s: float = 1.0
    """After a failed index-store call the write path skips the store this long (streams
    are counted as store errors and resynced later), then lets one call probe it."""
    reconnect_min_s: float = 0.1
    """First ZeroMQ reconnect back-off."""
    reconnect_max_s: float = 5.0
    """Longest ZeroMQ reconnect back-off."""
    key_cache_size: int = -1
    """Recent engine hash → key mappings cached per stream to find a parent's key, beyond
    the last two batches' (always at hand). On Redis they save index round trips; in memory
    the index answers as fast, and a cache there would only cost memory (about 100 bytes an
    entry, over twice the index's own). -1: 65,536 on Redis, 0 in memory
    (:attr:`key_cache_entries`)."""
    max_open_files: int = 0
    """Soft open-file limit (``RLIMIT_NOFILE``) the indexer raises itself to at start, never
    above the hard limit nor lowered (0: the hard limit). A connect-mode stream needs about
    4 open files, 2 more while it replays."""
    log_level: str = "INFO"
    """Python logging level."""
    status_host: str = "127.0.0.1"
    """Listen address of ``kvindex indexer``'s status port (``0.0.0.0``: every interface)."""
    status_port: int = 8090
    """``kvindex indexer``'s port for /metrics, /healthz, /readyz (0: any free one, logged;
    -1: none)."""
    status_probe_s: float = 0.5
    """Seconds between two store probes, whose last answer /readyz reports."""
    status_timeout_s: float = 0.25
    """Socket timeout of the store probe and of the status port's index reads."""
    shard: ShardMode = "auto"
    """Split the streams between the indexers on one Redis (leases, rendezvous hash, a
    fence on every batch): ``auto`` = on with ``store = "redis"``, off in memory; ``off``:
    one indexer per store, as before (two would fight over each stream)."""
    indexer_id: str = ""
    """This indexer's name among the sharded ones (shown as each stream's owner); "" = the
    host name (kept across a restart). Several indexers on one host need one each."""
    lease_ttl_s: float = 10.0
    """A sharded indexer that has not renewed its lease for this long (renewed every third
    of it) loses its streams to the others: the takeover bound is this, plus a third of it,
    plus one replay."""
    ingest_workers: int = 0
    """Subscriber loops of the memory store's write path, each owning the sockets and the
    pipeline of its share of the connect-mode streams (a stream stays on one loop: its
    batches keep their order); the bound SUB is read by the first. They overlap only where
    the compiled ingest runs without the GIL (README, Performance). 0: one per two cores
    available to the process (``os.sched_getaffinity``: a worker's core, and one for the
    API and everything else that holds the GIL), at least 1, at most
    :data:`MAX_AUTO_INGEST_WORKERS` (on 2 cores, 1).
    On Redis one loop per process (run more sharded indexers to use more cores); a count
    above 1 there is refused."""

    @property
    def key_cache_entries(self) -> int:
        """``key_cache_size`` with -1 resolved for the store."""
        if self.key_cache_size >= 0:
            return self.key_cache_size
        return 65_536 if self.store == "redis" else 0

    @property
    def num_ingest_workers(self) -> int:
        """``ingest_workers`` with 0 resolved: 1 on Redis, else one per two cores available
        to the process, between 1 and :data:`MAX_AUTO_INGEST_WORKERS`."""
        if self.ingest_workers > 0:
            return self.ingest_workers
        if self.store == "redis":
            return 1
        return max(1, min(len(os.sched_getaffinity(0)) // 2, MAX_AUTO_INGEST_WORKERS))

    @property
    def sharded(self) -> bool:
        """Whether this process shares the streams with other indexers on its store."""
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


_SCALARS = {f.name: f for f in fields(IndexerSettings) if f.name != "replicas"}
_STORE_KEYS = frozenset(f.name for f in fields(StoreSettings))


def load_settings(
    source: Path | ConfigFile | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    extra_replicas: tuple[ReplicaSpec, ...] = (),
) -> IndexerSettings:
    """Defaults < the config file's top level < ``KVINDEX_*`` env < ``overrides`` (None
    values ignored); the file's replicas, then ``extra_replicas``."""
    file = source if isinstance(source, ConfigFile) else ConfigFile.read(source)
    file_values = _checked(file)
    replicas = _replicas_from_toml(file_values.pop("replicas", []), file.path)
    values = layered(file_values, _from_env(os.environ if env is None else env), overrides)
    try:
        return IndexerSettings(**_coerce(values), replicas=(*replicas, *extra_replicas))
    except TypeError as exc:
        raise SettingsError(str(exc)) from exc


def load_store_settings(
    source: Path | ConfigFile | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> StoreSettings:
    """The store keys alone, layered as :func:`load_settings` layers them (the file's other
    indexer keys are checked as names, not read)."""
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
    """The file's top level; SettingsError names the keys no indexer setting has."""
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
    """A copy with some fields changed (validated again)."""
    return dataclasses.replace(settings, **changes)
