"""The whole stack with real parts: publishers (ZeroMQ PUB + replay ROUTER, vLLM's format)
→ indexer → redis-server → the API served by uvicorn on loopback → ``POST /score``; every
test runs on standalone Redis and on a 3-master Redis Cluster, given one node's URL as a
user would (kvindex finds out it is a cluster)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import httpx
import pytest

from kvindex.api.config.settings import ApiSettings
from kvindex.api.http.app import create_app
from kvindex.api.http.server import Service
from kvindex.clients.fake_vllm.publisher import EventPublisher
from kvindex.indexer.domain.events import BlockRemoved, BlockStored, StreamId, Tier
from tests.integration.api_harness import BLOCK, MODEL, serving_http, tokens
from tests.integration.harness import (
    Indexer,
    publisher_at,
    replica_of,
    settings_for,
    wait_until,
    warm_up,
)
from tests.support.redis_cluster import ClusterNodes
from tests.support.redis_server import free_port

REPLICAS = ("r1", "r2")
SYSTEM = tokens(1_000, 4)
USER = tokens(50_000, 2, tail=3)


@dataclass
class Stack:
    """Running publishers (one per replica), indexer, API, and an HTTP client to the API."""

    publishers: dict[str, EventPublisher]
    indexer: Indexer
    http: httpx.Client
    cluster: ClusterNodes | None
    """The cluster under the stack (None: standalone Redis)."""

    def publish(self, replica: str, event: BlockStored | BlockRemoved) -> None:
        """Publish one batch and wait until the indexer has applied it."""
        seq = self.publishers[replica].publish([event])
        wait_until(self.indexer.applied(StreamId(replica), seq), what=f"{replica} seq {seq}")

    def score(self, token_ids: list[int]) -> dict[str, object]:
        response = self.http.post("/score", json={"model": MODEL, "token_ids": token_ids})
        assert response.status_code == 200, response.text
        answer: dict[str, object] = response.json()
        return answer


def _store_url(request: pytest.FixtureRequest) -> tuple[str, ClusterNodes | None]:
    """An empty store's URL (the fixtures flush it), and its cluster if it is one."""
    if request.param == "cluster":
        request.getfixturevalue("redis_cluster_client")
        cluster: ClusterNodes = request.getfixturevalue("redis_cluster")
        return cluster.url, cluster
    request.getfixturevalue("redis_client")
    url: str = request.getfixturevalue("redis_server").url
    return url, None


@pytest.fixture(params=["redis", "cluster"])
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    url, cluster = _store_url(request)
    with ExitStack() as cleanup:
        publishers = {}
        for replica in REPLICAS:
            publishers[replica] = publisher_at(None, None, topic=f"kv@{replica}@{MODEL}")
            cleanup.callback(publishers[replica].close)
        specs = [replica_of(publishers[r], r) for r in REPLICAS]
        settings = settings_for(*specs, store="redis", redis_url=url)
        api = ApiSettings(port=free_port(), scrape_interval_s=0)
        service = Service.build(settings, api)
        service.indexer.start()
        cleanup.callback(service.stop)
        base_url = cleanup.enter_context(serving_http(create_app(service.deps), api))
        http = cleanup.enter_context(httpx.Client(base_url=base_url, timeout=10))
        indexer = Indexer(service.indexer)
        for replica in REPLICAS:
            warm_up(indexer, publishers[replica], StreamId(replica))
        yield Stack(publishers, indexer, http, cluster)


def stored(token_ids: list[int], first_hash: int) -> BlockStored:
    num_blocks = len(token_ids) // BLOCK
    hashes = tuple(range(first_hash, first_hash + num_blocks))
    return BlockStored(hashes, None, token_ids, BLOCK, Tier.GPU)


def matched(answer: dict[str, object]) -> dict[str, int]:
    scores = answer["scores"]
    assert isinstance(scores, list)
    return {s["replica"]: s["matched_blocks"] for s in scores}


def test_score_routes_to_the_replica_holding_the_prefix(stack: Stack) -> None:
    stack.publish("r1", stored(SYSTEM, 100))
    stack.publish("r2", stored(tokens(90_000, 4), 200))
    answer = stack.score(SYSTEM + USER)
    assert answer["best"] == "r1"
    assert (answer["num_blocks"], answer["block_size"], answer["degraded"]) == (6, BLOCK, None)
    assert matched(answer) == {"r1": 4, "r2": 0}
    replicas = stack.http.get("/replicas").json()
    assert [(r["id"], r["state"], r["streams"][0]["blocks"]["gpu"]) for r in replicas] == [
        ("r1", "live", 4),
        ("r2", "live", 4),
    ]


def test_evicted_blocks_stop_attracting_requests(stack: Stack) -> None:
    stack.publish("r1", stored(SYSTEM, 100))
    stack.publish("r2", stored(SYSTEM[: 2 * BLOCK], 200))
    assert stack.score(SYSTEM)["best"] == "r1"
    stack.publish("r1", BlockRemoved((101, 102, 103), Tier.GPU))  # r1 keeps its first block
    answer = stack.score(SYSTEM)
    assert answer["best"] == "r2"
    assert matched(answer) == {"r1": 1, "r2": 2}


@pytest.mark.parametrize("stack", ["cluster"], indirect=True)
def test_on_a_cluster_the_keys_spread_over_its_masters(stack: Stack) -> None:
    stack.publish("r1", stored(SYSTEM, 100))
    stack.publish("r2", stored(SYSTEM, 200))
    assert matched(stack.score(SYSTEM)) == {"r1": 4, "r2": 4}
    assert stack.cluster is not None
    holding = [port for port, n in stack.cluster.num_keys_per_master().items() if n > 0]
    assert len(holding) > 1, stack.cluster.num_keys_per_master()
