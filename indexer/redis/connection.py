"""The one place kvindex builds a Redis client, standalone or Cluster, from a URL or, for a
cluster, several seed URLs (comma-separated; any one answering is enough). ``redis_cluster``:
``auto`` asks the seeds in turn (none answering: a cluster if several are given, else
standalone with a warning); a cluster none of whose seeds answers yet is a
:class:`PendingCluster`, which joins at its first use after one does."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeAlias, cast
from urllib.parse import urlsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.redis.urls import ClusterMode, safe_url, seeds_of

log = logging.getLogger("kvindex.redis")

RedisClient: TypeAlias = redis.Redis | RedisCluster

STORE_ERRORS = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.SlotNotCoveredError,
)
"""Errors meaning "the store cannot answer now" (not "the call was wrong")."""

CLUSTER_AS_STANDALONE = (
    "a Redis Cluster node used as standalone Redis (it could not be asked when this process "
    'started, or redis_cluster = "off"): restart the process, or set redis_cluster = "on"'
)


class StoreConnectError(KvIndexError):
    """A Redis Cluster whose slot map could not be read when its client was built."""


def is_cluster(url: str, *, timeout_s: float) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        info = client.info("cluster")
    finally:
        client.close()
    return bool(int(info.get("cluster_enabled", 0)))


def _wants_cluster(seeds: list[str], mode: ClusterMode, timeout_s: float) -> bool:
    if mode != "auto":
        return mode == "on"
    for seed in seeds:
        try:
            return is_cluster(seed, timeout_s=timeout_s)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("redis seed %s unreachable: %s", safe_url(seed), exc)
        except redis.ResponseError as exc:  # e.g. a database other than 0 on a cluster node
            raise StoreConnectError(f"redis at {safe_url(seed)}: {exc}") from exc
    if len(seeds) > 1:
        log.warning("no redis seed answers: several seeds name a cluster, joined when one does")
        return True
    log.warning(
        "redis at %s unreachable, so not known to be a cluster: using it as standalone Redis "
        '(for a cluster, list several seed URLs or set redis_cluster = "on")',
        safe_url(seeds[0]),
    )
    return False


def _cluster(seeds: list[str], retry: Retry, timeout_s: float) -> RedisCluster:
    """A cluster client, its slot map read through any seed; none answering: pending."""
    kwargs: dict[str, Any] = {
        "retry": retry,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "health_check_interval": 30,
    }
    for seed in seeds:
        if urlsplit(seed).path.strip("/") not in ("", "0"):
            raise StoreConnectError(f"redis cluster at {safe_url(seed)}: only database 0")
    try:
        return _joined(seeds, kwargs)
    except (redis.exceptions.RedisClusterException, *STORE_ERRORS) as exc:
        return PendingCluster(seeds, kwargs, first_error=exc)


def _joined(seeds: list[str], kwargs: dict[str, Any]) -> RedisCluster:
    return RedisCluster(url=seeds[0], startup_nodes=_other_nodes(seeds), **kwargs)


def _other_nodes(seeds: list[str]) -> list[ClusterNode]:
    """Every seed after the first (the first also gives the credentials and options)."""
    nodes = []
    for seed in seeds[1:]:
        parts = urlsplit(seed)
        nodes.append(_node(parts.hostname or "localhost", parts.port or 6379))
    return nodes


_node = cast("Callable[[str, int], ClusterNode]", ClusterNode)


class PendingCluster(RedisCluster):
    """A cluster client built while none of its seeds answered. Each use tries to join (at
    most once per back-off, 0.5 s doubling to 5 s; one thread at a time) and, until one
    does, raises ``redis.ConnectionError``: the store is unavailable, as with a node down.
    Once joined it is the ordinary client. Thread-safe."""

    _MIN_WAIT_S, _MAX_WAIT_S = 0.5, 5.0

    def __init__(self, seeds: list[str], kwargs: dict[str, Any], *, first_error: Exception) -> None:
        # Not RedisCluster.__init__ (it reads the slot map): until a join, the attributes
        # it sets are missing and __getattr__ tries to join.
        self._seeds, self._kwargs = seeds, kwargs
        self._joining = threading.Lock()
        self._joined = False
        self._wait_s = self._MIN_WAIT_S
        self._next_try = time.monotonic() + self._wait_s
        self.num_join_failures = 1
        self.encoder = redis.Redis().get_encoder()  # what register_script asks first
        log.warning(
            "redis cluster at %s: no seed answers (%s); the store is unavailable until one "
            "does (retrying, every %.0f s at most)",
            safe_url(",".join(seeds)),
            first_error,
            self._MAX_WAIT_S,
        )

    def __getattr__(self, name: str) -> Any:
        # Only reached for an attribute not set: one RedisCluster.__init__ sets.
        if name.startswith("__") or self.__dict__.get("_joined", True):
            raise AttributeError(name)
        self._join()
        return object.__getattribute__(self, name)

    def _join(self) -> None:
        if not self._joining.acquire(blocking=False):
            raise redis.ConnectionError("redis cluster: joining through its seeds")
        try:
            if self._joined:
                return
            if time.monotonic() < self._next_try:
                raise redis.ConnectionError("redis cluster: no seed answers yet")
            try:
                RedisCluster.__init__(
                    self,
                    url=self._seeds[0],
                    startup_nodes=_other_nodes(self._seeds),
                    **self._kwargs,
                )
            except (redis.exceptions.RedisClusterException, *STORE_ERRORS) as exc:
                self._failed(exc)
            self._joined = True
            log.warning("redis cluster at %s joined", safe_url(",".join(self._seeds)))
        finally:
            self._joining.release()

    def _failed(self, exc: Exception) -> None:
        self.num_join_failures += 1
        self._wait_s = min(self._wait_s * 2, self._MAX_WAIT_S)
        self._next_try = time.monotonic() + self._wait_s
        log.debug("redis cluster: no seed answers (%d tries): %s", self.num_join_failures, exc)
        raise redis.ConnectionError(f"redis cluster: no seed answers: {exc}") from exc

    def close(self) -> None:
        if self.__dict__.get("_joined", False):
            super().close()

    def __repr__(self) -> str:
        joined = self.__dict__.get("_joined", False)
        return f"<PendingCluster {safe_url(','.join(self._seeds))} joined={joined}>"


def connect(
    url: str, *, cluster: ClusterMode = "auto", socket_timeout_s: float = 5.0
) -> RedisClient:
    """A client of ``url`` (several comma-separated seed URLs: a cluster's)."""
    retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), 3)
    seeds = seeds_of(url)
    if _wants_cluster(seeds, cluster, socket_timeout_s):
        return _cluster(seeds, retry, socket_timeout_s)
    return redis.Redis.from_url(
        seeds[0],
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=30,
    )


def connect_bounded(url: str, *, timeout_s: float, cluster: ClusterMode = "auto") -> RedisClient:
    """A client for a process that answers requests: every call returns or fails within
    about ``timeout_s``; a dropped connection is retried once, a timeout is not."""
    seeds = seeds_of(url)
    if _wants_cluster(seeds, cluster, timeout_s):
        return _cluster(seeds, Retry(NoBackoff(), 1), timeout_s)
    return redis.Redis.from_url(
        seeds[0],
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        retry_on_error=[],
        health_check_interval=30,
    )


def ping(client: RedisClient) -> bool:
    if isinstance(client, RedisCluster):
        return bool(client.ping(target_nodes=RedisCluster.PRIMARIES))
    return bool(client.ping())
