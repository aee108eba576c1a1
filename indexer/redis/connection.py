"""The one place kvindex builds a Redis client, standalone or Cluster (``redis_cluster``: ``auto``
asks the node, falling back to standalone with a warning; a cluster client reads its slot map when
built, else :class:`StoreConnectError`)."""

from __future__ import annotations

import logging
from typing import Literal, TypeAlias, get_args

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from kvindex.indexer.domain.errors import KvIndexError

log = logging.getLogger("kvindex.redis")

RedisClient: TypeAlias = redis.Redis | RedisCluster

ClusterMode = Literal["auto", "on", "off"]
CLUSTER_MODES: tuple[str, ...] = get_args(ClusterMode)

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


def _wants_cluster(url: str, mode: ClusterMode, timeout_s: float) -> bool:
    if mode != "auto":
        return mode == "on"
    try:
        return is_cluster(url, timeout_s=timeout_s)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        log.warning(
            "redis at %s unreachable, so not known to be a cluster: using it as standalone "
            'Redis (set redis_cluster = "on" for a cluster): %s',
            _safe(url),
            exc,
        )
        return False
    except redis.ResponseError as exc:  # e.g. a database other than 0 on a cluster node
        raise StoreConnectError(f"redis at {_safe(url)}: {exc}") from exc


def _safe(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url


def _cluster(url: str, retry: Retry, timeout_s: float) -> RedisCluster:
    try:
        return RedisCluster.from_url(
            url,
            retry=retry,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            health_check_interval=30,
        )
    except (redis.exceptions.RedisClusterException, *STORE_ERRORS) as exc:  # the slot map
        raise StoreConnectError(f"redis cluster at {_safe(url)}: {exc}") from exc


def connect(
    url: str, *, cluster: ClusterMode = "auto", socket_timeout_s: float = 5.0
) -> RedisClient:
    retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), 3)
    if _wants_cluster(url, cluster, socket_timeout_s):
        return _cluster(url, retry, socket_timeout_s)
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=30,
    )


def connect_bounded(url: str, *, timeout_s: float, cluster: ClusterMode = "auto") -> RedisClient:
    """A client for a process that answers requests: every call returns or fails within
    about ``timeout_s``; a dropped connection is retried once, a timeout is not."""
    if _wants_cluster(url, cluster, timeout_s):
        return _cluster(url, Retry(NoBackoff(), 1), timeout_s)
    return redis.Redis.from_url(
        url,
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
