"""Dynamo's indexer API on ``kvindex api`` (Redis, the indexer in another process's place):
a worker registered through the API process is picked up by the indexer from Redis, its events
answer ``/query`` there, and ``/unregister`` drops it for both."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
import redis

from kvindex.api.config.settings import ApiSettings, ReadPathSettings
from kvindex.api.http.app import create_app
from kvindex.api.http.background import BackgroundServer
from kvindex.api.runtime import open_stores
from kvindex.clients.fake_vllm.publisher import EventPublisher
from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.domain.events import BlockStored, Tier
from kvindex.indexer.service import IndexerService
from tests.integration.api_harness import BLOCK, MODEL, tokens
from tests.integration.harness import publisher_at, wait_until
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.redis_server


@pytest.fixture
def api_and_publisher(
    redis_server: RedisServer, redis_client: redis.Redis
) -> Iterator[tuple[httpx.Client, EventPublisher]]:
    settings = IndexerSettings(store="redis", redis_url=redis_server.url)
    with ExitStack() as cleanup:
        indexer = IndexerService.build(settings)
        indexer.start()
        cleanup.callback(indexer.stop)
        deps = open_stores(ReadPathSettings(settings, ApiSettings(scrape_interval_s=0.0)))
        cleanup.callback(deps.index.close)
        http = cleanup.enter_context(BackgroundServer(create_app(deps)))
        client = cleanup.enter_context(httpx.Client(base_url=http.base_url, timeout=10))
        publisher = publisher_at(None, None, topic="", replay=False)
        cleanup.callback(publisher.close)
        yield client, publisher


def _query(client: httpx.Client, token_ids: list[int]) -> Any:
    return client.post("/query", json={"token_ids": token_ids, "model_name": MODEL}).json()


def test_a_worker_registered_on_the_api_is_indexed_and_dropped(
    api_and_publisher: tuple[httpx.Client, EventPublisher],
) -> None:
    client, publisher = api_and_publisher
    body = {
        "instance_id": 42,
        "endpoint": publisher.endpoint,
        "model_name": MODEL,
        "block_size": BLOCK,
    }
    assert client.post("/register", json=body).status_code == 201
    prompt = tokens(3_000, 4)

    def indexed() -> bool:  # the indexer subscribes after its next fleet read: resend till seen
        publisher.publish([BlockStored(tuple(range(1, 5)), None, prompt, BLOCK, Tier.GPU)])
        return bool(_query(client, prompt).get("scores"))

    wait_until(indexed, timeout_s=15, what="the registered worker's blocks")
    assert _query(client, prompt)["scores"] == {"42": {"0": 4 * BLOCK}}
    (worker,) = client.get("/workers").json()
    assert (worker["instance_id"], worker["endpoints"]) == (42, {"0": publisher.endpoint})
    done = client.post("/unregister", json={"instance_id": 42, "model_name": MODEL})
    assert done.status_code == 200
    assert client.get("/workers").json() == []
    assert client.post("/query", json={"token_ids": prompt, "model_name": MODEL}).status_code == 404
