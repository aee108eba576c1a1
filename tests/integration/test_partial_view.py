"""A gap past the replica's replay buffer, black-box: the indexer stopped while the replica
published more batches than its buffer keeps. The stream is rebuilt from what the replica sends
next and reads ``partial`` (with its reason and since when) in ``/score``, ``/replicas``,
``kvindex replicas`` and the metrics while blocks the replica holds are unknown; only the
replica's cache reset (``AllBlocksCleared``) makes it ``live`` again. On the memory store
(``kvindex serve``: the restarted index is empty) and on Redis (``kvindex indexer`` and
``kvindex api``: the index kept its blocks and watermark, and a restarted indexer resumes the
partial view the last one published)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvindex.clients.fake_vllm.publisher import EventPublisher
from kvindex.indexer.domain.events import AllBlocksCleared, BlockStored, Tier
from tests.integration.harness import MODEL, publisher_at, wait_until
from tests.support.processes import KVINDEX, Child, http_ok, kvindex_child
from tests.support.redis_server import RedisServer, free_ports

pytestmark = pytest.mark.timeout(120)

BLOCK = 16
BUFFER = 20
"""Batches the replica's replay buffer keeps."""
NUM_HELD = 6
"""Prompts stored before the indexer stops; the replica keeps them all (nothing removed)."""


def prompt(i: int) -> list[int]:
    return list(range(10_000 * (i + 1), 10_000 * (i + 1) + 2 * BLOCK))


def stored(i: int) -> BlockStored:
    """Prompt ``i``'s two blocks, a chain of their own."""
    return BlockStored((2 * i + 1, 2 * i + 2), None, prompt(i), BLOCK, Tier.GPU)


@dataclass
class Fleet:
    """One replica's publisher, the indexer (restartable) and the API it feeds."""

    publisher: EventPublisher
    indexer: Child
    api_url: str
    metrics_url: str
    expected_reason: str

    def score(self, i: int) -> dict[str, Any]:
        body = {"model": MODEL, "token_ids": prompt(i)}
        answer = httpx.post(f"{self.api_url}/score", json=body, timeout=5, trust_env=False)
        assert answer.status_code == 200, answer.text
        entry: dict[str, Any] = answer.json()["scores"][0]
        assert entry["replica"] == "r1"
        return entry

    def replica_view(self) -> dict[str, Any]:
        answer = httpx.get(f"{self.api_url}/replicas", timeout=5, trust_env=False)
        views: list[dict[str, Any]] = answer.json()
        return views[0]

    def metrics(self) -> str:
        return httpx.get(self.metrics_url, timeout=5, trust_env=False).text


def _spec(publisher: EventPublisher) -> str:
    return f"id=r1,model={MODEL},events={publisher.endpoint},replay={publisher.replay_endpoint}"


@pytest.fixture(params=["memory", "redis"])
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fleet]:
    publisher = publisher_at(None, None, buffer_steps=BUFFER)
    api_port, status_port = free_ports(2)
    common = ["--replica", _spec(publisher), "--stats-every", "0"]
    with ExitStack() as stack:
        stack.callback(publisher.close)
        if request.param == "memory":
            args = ["serve", "--store", "memory", "--port", str(api_port), *common]
            ready = http_ok(api_port, "/healthz")
            indexer = kvindex_child("serve", args, tmp_path / "serve.log", ready)
            metrics, reason = f"http://127.0.0.1:{api_port}/metrics", "start_past_buffer"
        else:
            redis: RedisServer = request.getfixturevalue("redis_server")
            request.getfixturevalue("redis_client")  # flushed: a store of this test's own
            store = ["--store", "redis", "--redis-url", redis.url]
            args = ["indexer", *store, "--status-port", str(status_port), *common]
            ready = http_ok(status_port, "/healthz")
            indexer = kvindex_child("indexer", args, tmp_path / "indexer.log", ready)
            api = kvindex_child(
                "api",
                ["api", "--redis-url", redis.url, "--port", str(api_port)],
                tmp_path / "api.log",
                http_ok(api_port, "/healthz"),
            )
            stack.callback(api.stop)
            api.start()
            metrics, reason = f"http://127.0.0.1:{status_port}/metrics", "replay_gap_past_buffer"
        stack.callback(indexer.stop)
        indexer.start()
        yield Fleet(publisher, indexer, f"http://127.0.0.1:{api_port}", metrics, reason)


def _indexed(fleet: Fleet, i: int) -> bool:
    """Prompt ``i`` fully matched on r1 (False while the API does not know the model yet)."""
    body = {"model": MODEL, "token_ids": prompt(i)}
    answer = httpx.post(f"{fleet.api_url}/score", json=body, timeout=5, trust_env=False)
    return answer.status_code == 200 and answer.json()["scores"][0]["matched_blocks"] == 2


def test_a_gap_past_the_replay_buffer_reads_partial_until_the_cache_is_reset(
    fleet: Fleet,
) -> None:
    for i in range(NUM_HELD):
        fleet.publisher.publish([stored(i)])
    wait_until(lambda: all(_indexed(fleet, i) for i in range(NUM_HELD)), 20, "prompts indexed")
    wait_until(lambda: fleet.score(0)["freshness"]["state"] == "live", 10, "live")

    fleet.indexer.stop()
    num_later = 3 * BUFFER  # far past the buffer: the first prompts' batches are gone from it
    for i in range(NUM_HELD, NUM_HELD + num_later):
        fleet.publisher.publish([stored(i)])
    fleet.indexer.start()
    last = NUM_HELD + num_later - 1
    wait_until(lambda: _indexed(fleet, last), 20, "the buffered batches replayed")
    # Redis: the API reads the new indexer's record within its publish period (1 s).
    wait_until(lambda: fleet.score(0)["freshness"]["state"] == "partial", 10, "partial")

    held_unknown = [i for i in range(NUM_HELD) if fleet.score(i)["matched_blocks"] == 0]
    assert held_unknown == list(range(NUM_HELD))  # the replica holds them; the index cannot
    freshness = fleet.score(0)["freshness"]
    assert (freshness["state"], freshness["partial"]) == ("partial", fleet.expected_reason)
    assert freshness["partial_since"] > 0
    view = fleet.replica_view()
    assert view["state"] == "partial"
    assert view["streams"][0]["freshness"]["partial"] == fleet.expected_reason
    metrics = fleet.metrics()
    assert 'kvindex_streams{state="partial"} 1.0' in metrics
    assert f'reason="{fleet.expected_reason}"' in metrics
    shown = subprocess.run(
        [str(KVINDEX), "replicas", "--url", fleet.api_url],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert f"partial: {fleet.expected_reason}" in shown, shown

    fleet.publisher.publish([stored(last + 1)])  # what the replica stores now: still partial
    wait_until(lambda: _indexed(fleet, last + 1), 10, "a later store")
    assert fleet.score(0)["freshness"]["state"] == "partial"

    fleet.indexer.stop()  # an indexer restarted: a partial view stays partial
    fleet.indexer.start()
    seq = fleet.publisher.publish([stored(last + 2)])
    wait_until(lambda: fleet.replica_view()["streams"][0]["last_seq"] == seq, 20, "its record")
    again = fleet.score(0)["freshness"]
    assert (again["state"], again["partial"]) == ("partial", fleet.expected_reason)
    if fleet.expected_reason == "replay_gap_past_buffer":  # Redis: resumed, since and all
        assert again["partial_since"] == freshness["partial_since"]

    fleet.publisher.publish([AllBlocksCleared()])  # the cache reset: nothing unknown is held
    fleet.publisher.publish([stored(0)])
    wait_until(lambda: _indexed(fleet, 0), 10, "the store after the reset")
    wait_until(lambda: fleet.score(0)["freshness"]["state"] == "live", 10, "live again")
    assert "partial" not in fleet.score(0)["freshness"]
    assert fleet.replica_view()["state"] == "live"
