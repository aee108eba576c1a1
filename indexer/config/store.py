"""The store settings every process kind shares (top-level keys, ``KVINDEX_<FIELD>``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args
from urllib.parse import urlsplit

from kvindex.indexer.domain.errors import SettingsError
from kvindex.indexer.redis.schema import (
    MAX_INDEX_GROUPS,
    TOPOLOGY_INDEX_GROUPS,
    Schema,
    SchemaError,
    check_name,
)
from kvindex.indexer.redis.urls import CLUSTER_MODES, ClusterMode, safe_url, seeds_of

StoreKind = Literal["memory", "redis"]


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """The store connection: what ``kvindex api`` reads of the indexer's keys."""

    store: StoreKind = "memory"
    """Index store: ``memory`` (in-process, one process) or ``redis`` (shared)."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis URL when ``store = "redis"``; on Redis Cluster, seed nodes' URLs, comma-separated."""
    redis_cluster: ClusterMode = "auto"
    """Redis Cluster or standalone: ``auto`` asks the seeds at start, ``on`` / ``off`` say it."""
    redis_prefix: str = "kvindex"
    """Prefix of every Redis key (several deployments can share one Redis)."""
    redis_index_groups: int = TOPOLOGY_INDEX_GROUPS
    """Redis index stream groups, 1-1024 (0: 1, 16 on a cluster); every process must agree."""
    stale_after_s: float = 300.0
    """A replica silent (or disconnected) this long is marked stale."""

    @property
    def redis_schema(self) -> Schema:
        return Schema(self.redis_prefix, self.redis_index_groups)

    def __post_init__(self) -> None:
        check_store(self)


def check_store(settings: StoreSettings) -> None:
    if settings.store not in get_args(StoreKind):
        raise SettingsError(f"store must be one of {get_args(StoreKind)}, got {settings.store!r}")
    if settings.redis_cluster not in CLUSTER_MODES:
        raise SettingsError(
            f"redis_cluster must be one of {CLUSTER_MODES}, got {settings.redis_cluster!r}"
        )
    check_seeds(settings)
    try:
        check_name("redis_prefix", settings.redis_prefix)
    except SchemaError as exc:
        raise SettingsError(str(exc)) from exc
    if not TOPOLOGY_INDEX_GROUPS <= settings.redis_index_groups <= MAX_INDEX_GROUPS:
        raise SettingsError(
            f"redis_index_groups must be 1 to {MAX_INDEX_GROUPS} (0: by topology),"
            f" got {settings.redis_index_groups!r}"
        )
    if settings.stale_after_s < 0:
        raise SettingsError(f"stale_after_s must be >= 0, got {settings.stale_after_s!r}")


def check_seeds(settings: StoreSettings) -> None:
    """One URL, or several (a cluster's seeds) unless ``redis_cluster = "off"``; each
    ``redis://``, ``rediss://`` or ``unix://``. Errors never show credentials."""
    seeds = seeds_of(settings.redis_url)
    if not seeds:
        raise SettingsError("redis_url is empty")
    for seed in seeds:
        if urlsplit(seed).scheme not in ("redis", "rediss", "unix"):
            raise SettingsError(
                f"redis_url {safe_url(seed)!r}: each URL starts redis://, rediss:// or unix://"
            )
    if len(seeds) > 1 and settings.redis_cluster == "off":
        raise SettingsError(
            f"redis_url {safe_url(settings.redis_url)!r}: several URLs are a cluster's seeds,"
            ' but redis_cluster = "off"'
        )
