"""The one Redis client factory: standalone or cluster, told or found out from its seeds.

These use the session's private redis-server and 3-master cluster (``tests/conftest.py``):
what is detected is what a real server answers."""

from __future__ import annotations

import logging
import signal
import time

import pytest
import redis
from redis.cluster import RedisCluster

from kvindex.indexer.redis.connection import (
    PendingCluster,
    StoreConnectError,
    connect,
    connect_bounded,
    is_cluster,
    ping,
)
from kvindex.indexer.redis.urls import safe_url
from tests.support.redis_cluster import ClusterNodes
from tests.support.redis_server import RedisServer, free_port


def test_a_standalone_server_is_not_a_cluster(redis_server: RedisServer) -> None:
    assert is_cluster(redis_server.url, timeout_s=1.0) is False
    for client in (connect(redis_server.url), connect_bounded(redis_server.url, timeout_s=1.0)):
        assert type(client) is redis.Redis
        assert client.ping()
        client.close()


def test_any_node_of_a_cluster_gives_a_cluster_client(redis_cluster: ClusterNodes) -> None:
    for port in redis_cluster.ports:
        url = f"redis://127.0.0.1:{port}/0"
        assert is_cluster(url, timeout_s=1.0) is True
        client = connect_bounded(url, timeout_s=1.0)
        assert isinstance(client, RedisCluster)
        nodes = client.nodes_manager.nodes_cache.values()
        assert {node.port for node in nodes} == set(redis_cluster.ports)  # found from one
        client.close()


def test_the_setting_overrides_detection(redis_cluster: ClusterNodes) -> None:
    told = connect(redis_cluster.url, cluster="off")
    assert type(told) is redis.Redis  # a user who says standalone gets standalone
    told.close()
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    lazy = connect(unreachable, cluster="off", socket_timeout_s=0.2)  # connects on first use
    with pytest.raises(redis.ConnectionError):
        lazy.ping()
    lazy.close()


def test_an_unreachable_node_in_auto_mode_is_used_as_standalone_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"redis://user:s3cret@127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.WARNING, logger="kvindex.redis"):
        client = connect_bounded(url, timeout_s=0.2)
    assert type(client) is redis.Redis
    assert 'redis_cluster = "on"' in caplog.text
    assert "s3cret" not in caplog.text
    client.close()


def test_a_cluster_that_cannot_be_reached_is_pending_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"redis://user:s3cret@127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.WARNING, logger="kvindex.redis"):
        client = connect(url, cluster="on", socket_timeout_s=0.2)
    assert isinstance(client, PendingCluster)
    with pytest.raises(redis.ConnectionError):
        client.ping()
    assert "no seed answers" in caplog.text and "s3cret" not in caplog.text
    client.close()


def test_any_seed_that_answers_is_enough(redis_cluster: ClusterNodes) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    for mode in ("auto", "on"):
        client = connect_bounded(f"{dead}, {redis_cluster.url}", timeout_s=0.5, cluster=mode)
        assert type(client) is RedisCluster
        nodes = client.nodes_manager.nodes_cache.values()
        assert {node.port for node in nodes} == set(redis_cluster.ports)
        client.close()


def test_several_dead_seeds_in_auto_mode_are_a_pending_cluster() -> None:
    seeds = ",".join(f"redis://127.0.0.1:{port}/0" for port in (free_port(), free_port()))
    client = connect_bounded(seeds, timeout_s=0.2)
    assert isinstance(client, PendingCluster)
    client.close()


def test_a_pending_cluster_joins_once_its_seed_answers(redis_cluster: ClusterNodes) -> None:
    seed = redis_cluster.processes[0]
    seed.send_signal(signal.SIGSTOP)  # answers nothing (within its node timeout)
    try:
        client = connect_bounded(redis_cluster.url, timeout_s=0.3, cluster="on")
        assert isinstance(client, PendingCluster)
        with pytest.raises(redis.ConnectionError):
            client.set("k", b"v")
    finally:
        seed.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 10.0
    while True:
        try:
            assert ping(client)
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "never joined"
            time.sleep(0.1)
    assert client.set("k", b"v") and client.get("k") == b"v"
    assert {node.port for node in client.nodes_manager.nodes_cache.values()} == set(
        redis_cluster.ports
    )
    client.close()


def test_credentials_never_show_in_a_safe_url() -> None:
    url = "redis://u:pw1@a:1/0, rediss://:pw2@b:2"
    assert safe_url(url) == "redis://a:1/0,rediss://b:2"


def test_a_database_other_than_0_on_a_cluster_is_a_named_error(
    redis_cluster: ClusterNodes,
) -> None:
    with pytest.raises(StoreConnectError):
        connect(redis_cluster.url.removesuffix("/0") + "/3")


def test_ping_asks_every_master_of_a_cluster(
    redis_cluster: ClusterNodes, redis_server: RedisServer
) -> None:
    client = connect_bounded(redis_cluster.url, timeout_s=0.3)
    assert ping(client) is True
    stopped = redis_cluster.processes[2]
    stopped.send_signal(signal.SIGSTOP)  # one master stops answering (well within its
    try:  # node timeout: the cluster does not fail it over)
        with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
            ping(client)
    finally:
        stopped.send_signal(signal.SIGCONT)
        client.close()
    standalone = connect_bounded(redis_server.url, timeout_s=0.5)
    assert ping(standalone) is True
    standalone.close()
