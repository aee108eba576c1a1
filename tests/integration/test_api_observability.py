"""What an API process tells its operator: /metrics series by route, degraded answers, the
store's state, scrape failures, block-size mismatches, and the access log.

The in-process app (``open_api``) over the memory store, plus an API-only process
(``runtime.open_stores``, as ``kvindex api`` builds it) on a private redis-server that is killed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvindex.api.config.settings import ApiSettings, ReadPathSettings
from kvindex.api.http.app import create_app
from kvindex.api.http.background import BackgroundServer
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.runtime import open_stores
from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.fleet.sync import FleetSync
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.redis.connection import connect
from kvindex.indexer.redis.schema import Schema
from tests.integration.api_harness import MODEL, Api, Fleet, open_api, tokens
from tests.integration.harness import wait_until
from tests.support.redis_server import free_port, running_redis
from tests.support.score_load import run_load

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
SETTINGS = ApiSettings(scrape_interval_s=0.0, seed=0)
WRITE_PATH_SERIES = ("kvindex_batches_total", "kvindex_blocks", "kvindex_streams")


def parsed(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def fetched(base_url: str) -> Samples:
    response = httpx.get(f"{base_url}/metrics", timeout=5.0, trust_env=False)
    assert response.status_code == 200
    return parsed(response.text)


def metrics_of(api: Api) -> Samples:
    response = api.get("/metrics")
    assert response.status_code == 200
    return parsed(response.text)


def requests_of(found: Samples, route: str, method: str, status: int) -> float:
    labels = (("method", method), ("route", route), ("status", str(status)))
    return found.get(("kvindex_http_requests_total", labels), 0.0)


@pytest.fixture
def memory_api() -> Iterator[Api]:
    api = open_api(SETTINGS, MemoryIndex(), MemoryLoadStore(), blocking_store=False)
    api.fleet.add("r1", "r2")
    api.fleet.store("r1", tokens(0, 4))
    yield api
    api.close()


def test_requests_are_counted_by_route_template_method_and_status(memory_api: Api) -> None:
    api = memory_api
    api.score(token_ids=tokens(0, 4))
    api.score(token_ids=tokens(0, 2))
    assert api.post("/score", {"model": MODEL}).status_code == 422
    assert api.request("DELETE", "/replicas/no-such-replica").status_code == 404
    assert api.get("/no/such/route").status_code == 404
    assert api.get("/replicas").status_code == 200
    assert api.request("BREW", "/score").status_code == 405
    found = metrics_of(api)
    assert requests_of(found, "/score", "POST", 200) == 2
    assert requests_of(found, "/score", "POST", 422) == 1
    assert requests_of(found, "/replicas/{replica_id}", "DELETE", 404) == 1
    assert requests_of(found, "unmatched", "GET", 404) == 1
    assert requests_of(found, "/replicas", "GET", 200) == 1
    assert requests_of(found, "/score", "other", 405) == 1  # a method is no label of its own
    routes = {
        dict(labels).get("route") for name, labels in found if name.startswith("kvindex_http")
    }
    assert not any("no-such" in str(route) for route in routes)  # never a raw path
    latency = ("kvindex_http_request_seconds_count", (("route", "/score"),))
    assert found[latency] == 4
    assert found[("kvindex_api_store_up", ())] == 1  # the memory store is always up
    assert any(name == "kvindex_batches_total" for name, _ in found)  # it runs the write path


def test_the_access_log_is_off_by_default(
    memory_api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvindex.access"):
        memory_api.score(token_ids=tokens(0, 4))
    assert [r for r in caplog.records if r.name == "kvindex.access"] == []


def test_the_access_log_has_one_line_per_request_with_its_route(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = ApiSettings(scrape_interval_s=0.0, access_log=True)
    api = open_api(settings, MemoryIndex(), MemoryLoadStore(), blocking_store=False)
    try:
        api.fleet.add("r1")
        with caplog.at_level(logging.INFO, logger="kvindex.access"):
            api.score(token_ids=tokens(0, 4))
            api.request("DELETE", "/replicas/gone")
    finally:
        api.close()
    lines = [r for r in caplog.records if r.name == "kvindex.access"]
    assert [r.getMessage().rsplit(" ", 2)[0] for r in lines] == [
        "POST /score 200",
        "DELETE /replicas/gone 404",
    ]
    assert [(r.route, r.status) for r in lines] == [  # type: ignore[attr-defined]
        ("/score", 200),
        ("/replicas/{replica_id}", 404),
    ]
    assert all(r.duration_ms >= 0 for r in lines)  # type: ignore[attr-defined]


def test_a_block_size_mismatch_shows_in_replicas_and_metrics(memory_api: Api) -> None:
    api = memory_api
    api.fleet.add("r3")
    api.fleet.registry.record(StreamId("r3"), StreamReport(block_size=32))
    api.fleet.registry.record(StreamId("r2"), StreamReport(block_size=16))
    views = {v["id"]: v["streams"][0] for v in api.get("/replicas").json()}
    shown = {r: (s["block_size"], s["block_size_mismatch"]) for r, s in views.items()}
    assert shown == {"r1": (16, False), "r2": (16, False), "r3": (32, True)}
    found = metrics_of(api)
    assert found[("kvindex_block_size_mismatch_streams", (("model", MODEL),))] == 1


def test_failed_scrapes_of_a_replica_are_counted() -> None:
    settings = ApiSettings(scrape_interval_s=0.05, scrape_timeout_s=0.5)
    api = open_api(settings, MemoryIndex(), MemoryLoadStore(), blocking_store=False)
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    try:
        api.fleet.registry.add(ReplicaSpec("r9", MODEL, url=closed))
        key = ("kvindex_load_scrape_failures_total", (("replica", "r9"),))
        wait_until(lambda: metrics_of(api).get(key, 0) >= 2, timeout_s=5.0, what="failures")
    finally:
        api.close()


@pytest.mark.redis_server
def test_an_api_only_process_exports_its_own_series_not_the_fleets() -> None:
    """Several ``kvindex api`` pods on one Redis: the fleet's write-path series come from
    the indexer's port only (sum() over pods would count them once per pod); each pod says
    whether it reaches Redis and counts its degraded answers."""
    with running_redis() as server:
        writer = connect(server.url, socket_timeout_s=1.0)
        fleet = Fleet.over(RedisIndex(writer, Schema()))
        fleet.add("r1")
        fleet.store("r1", tokens(0, 4))
        FleetSync(writer, Schema(), fleet.registry).tick()
        settings = IndexerSettings(store="redis", redis_url=server.url)
        deps = open_stores(ReadPathSettings(settings, SETTINGS))
        body = {"model": MODEL, "token_ids": tokens(0, 4)}
        try:
            with BackgroundServer(create_app(deps)) as http:
                url = http.base_url
                found = fetched(url)
                assert not any(name in WRITE_PATH_SERIES for name, _ in found)
                assert found[("kvindex_api_store_up", ())] == 1
                server.process.kill()
                server.process.wait()
                samples = run_load(url, body, rate=50.0, duration_s=0.2)
                assert samples and all(s.degraded is not None for s in samples)
                found = fetched(url)
        finally:
            deps.index.close()
            writer.close()
    degraded = ("kvindex_degraded_answers_total", (("reason", "index_unavailable"),))
    assert found[degraded] == len(samples)
    assert found[("kvindex_api_store_up", ())] == 0
