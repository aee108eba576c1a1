"""The one Redis client factory: standalone or cluster, told or found out from one node.

These use the session's private redis-server and 3-master cluster (``tests/conftest.py``):
what is detected is what a real server answers."""

from __future__ import annotations

import logging
import signal

import pytest
import redis
from redis.cluster import RedisCluster

from kvindex.indexer.redis.connection import (
    StoreConnectError,
    connect,
    connect_bounded,
    is_cluster,
    ping,
)
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


def test_a_cluster_that_cannot_be_reached_is_a_named_error() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(StoreConnectError, match=r"^redis cluster at redis://127"):
        connect(url, cluster="on", socket_timeout_s=0.2)


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
