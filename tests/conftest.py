"""Shared fixtures: a real redis-server and a real 3-master Redis Cluster per test session
(the cluster started on first use), each flushed between the tests that use it; the
cyclic garbage collector paused for tests marked ``latency_bound`` (``support/collector``);
and an empty Hugging Face hub cache for every process of the run (no test reads this
machine's)."""

from __future__ import annotations

import os
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


@pytest.fixture(scope="session", autouse=True)
def _empty_hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Models with no ``tokenizer`` set find none in the hub cache, in this process and in
    every one it starts (they inherit the environment)."""
    before = os.environ.get("HF_HUB_CACHE")
    os.environ["HF_HUB_CACHE"] = str(tmp_path_factory.mktemp("hf-hub"))
    yield
    if before is None:
        os.environ.pop("HF_HUB_CACHE", None)
    else:
        os.environ["HF_HUB_CACHE"] = before


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
