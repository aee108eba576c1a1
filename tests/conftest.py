"""Shared fixtures: a real redis-server and a real 3-master Redis Cluster per test session
(the cluster started on first use), each flushed between the tests that use it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from redis.cluster import RedisCluster

from tests.support.redis_cluster import ClusterNodes, running_cluster
from tests.support.redis_server import RedisServer, running_redis


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One private redis-server for the whole run (never the machine's own Redis)."""
    with running_redis() as server:
        yield server


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[ClusterNodes]:
    """One private 3-master cluster for the whole run (about 3 s to start)."""
    with running_cluster() as nodes:
        yield nodes


@pytest.fixture
def redis_cluster_client(redis_cluster: ClusterNodes) -> Iterator[RedisCluster]:
    """A cluster client; every master flushed first (and its scripts with it)."""
    client = redis_cluster.client()
    client.flushall()
    client.script_flush()
    yield client
    client.close()
