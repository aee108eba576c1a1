"""Shared fixtures: a real redis-server and a real 3-master Redis Cluster per test session
(the cluster started on first use), each flushed between the tests that use it; and the
cyclic garbage collector paused for tests marked ``latency_bound`` (``support/collector``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext

import pytest
import redis
from redis.cluster import RedisCluster

from tests.support.collector import collector_paused
from tests.support.redis_cluster import ClusterNodes, running_cluster
from tests.support.redis_server import RedisServer, running_redis


@pytest.fixture(autouse=True)
def _collector_paused_if_latency_bound(request: pytest.FixtureRequest) -> Iterator[None]:
    """A ``latency_bound`` test runs with the collector paused: its bounds time the code
    under test, not a collection of the whole run's objects."""
    marked = request.node.get_closest_marker("latency_bound") is not None
    with collector_paused() if marked else nullcontext():
        yield


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
