"""kvindex.api.load.scraper: MetricsScraper over a mock transport (real HTTP: tests/integration)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import fakeredis
import httpx
import pytest

from kvindex.api.load.model import Load
from kvindex.api.load.scraper import MetricsScraper, ScrapeStats, ScrapeTarget
from kvindex.api.load.store import MemoryLoadStore, RedisLoadStore
from kvindex.api.load.vllm_metrics import KV_USAGE, RUNNING
from kvindex.indexer.index.protocol import IndexUnavailableError
from kvindex.indexer.redis.schema import Schema
from tests.unit.api.load.samples import NOW


def metrics_text(running: float, model: str = "m") -> str:
    labels = f'{{engine="0",model_name="{model}"}}'
    return f"{RUNNING}{labels} {running}\n{KV_USAGE}{labels} 0.5\n"


def handler(request: httpx.Request) -> httpx.Response:
    """``http://<host>/metrics``: host ``ok-<n>`` serves ``n`` running, ``err`` a 503."""
    host = request.url.host
    if request.url.path != "/metrics":
        return httpx.Response(404)
    if host.startswith("ok-"):
        return httpx.Response(200, text=metrics_text(float(host.removeprefix("ok-"))))
    return httpx.Response(503, text="busy")


class FailingStore(MemoryLoadStore):
    def put(self, replica: str, load: Load) -> None:
        raise IndexUnavailableError("redis: down")


def scrape_once(store: MemoryLoadStore, targets: Sequence[ScrapeTarget]) -> MetricsScraper:
    async def main() -> MetricsScraper:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            scraper = MetricsScraper(store, client, lambda: targets, clock=lambda: NOW)
            await scraper.scrape_once()
            return scraper

    return asyncio.run(main())


def test_scrape_stores_loads_and_counts() -> None:
    store = MemoryLoadStore()
    scraper = scrape_once(store, [("r1", "http://ok-3/", "m"), ("r2", "http://err", None)])
    assert store.get_many(["r1", "r2"]) == {"r1": Load(3.0, 0.0, 0.5, NOW, "scrape")}
    assert scraper.stats() == {
        "r1": ScrapeStats(num_scrapes=1, last_success_ts=NOW),
        "r2": ScrapeStats(
            num_scrapes=1, num_failures=1, last_error="GET http://err/metrics: HTTP 503"
        ),
    }


def test_api_processes_sharing_redis_scrape_each_replica_once_a_round() -> None:
    server = fakeredis.FakeServer()
    stores = [RedisLoadStore(fakeredis.FakeRedis(server=server), Schema("p")) for _ in range(2)]
    targets = [("r1", "http://ok-1/", "m"), ("r2", "http://ok-2/", "m")]
    fetched: list[str] = []

    def counting(request: httpx.Request) -> httpx.Response:
        fetched.append(request.url.host)
        return handler(request)

    async def main() -> list[MetricsScraper]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(counting)) as client:
            scrapers = [
                MetricsScraper(store, client, lambda: targets, interval_s=60.0, clock=lambda: NOW)
                for store in stores
            ]
            for scraper in scrapers:
                await scraper.scrape_once()
            return scrapers

    first, second = asyncio.run(main())
    assert sorted(fetched) == ["ok-1", "ok-2"]  # once each, by the first process
    assert stores[1].get_many(["r1", "r2"]) == {
        "r1": Load(1.0, 0.0, 0.5, NOW, "scrape"),
        "r2": Load(2.0, 0.0, 0.5, NOW, "scrape"),
    }
    assert {r: s.num_scrapes for r, s in first.stats().items()} == {"r1": 1, "r2": 1}
    assert second.stats() == {
        "r1": ScrapeStats(num_left_to_peers=1),
        "r2": ScrapeStats(num_left_to_peers=1),
    }


class UnclaimableStore(MemoryLoadStore):
    def claim_scrapes(self, replicas: Sequence[str], hold_s: float) -> set[str]:
        raise IndexUnavailableError("redis: down")


def test_claims_that_cannot_be_made_leave_every_replica_to_scrape() -> None:
    store = UnclaimableStore()
    scraper = scrape_once(store, [("r1", "http://ok-3/", "m")])
    assert store.get_many(["r1"]) == {"r1": Load(3.0, 0.0, 0.5, NOW, "scrape")}
    assert scraper.stats() == {"r1": ScrapeStats(num_scrapes=1, last_success_ts=NOW)}


def test_replicas_without_url_are_not_scraped() -> None:
    store = MemoryLoadStore()
    scraper = scrape_once(store, [("r1", None, "m"), ("r2", "", "m")])
    assert scraper.stats() == {}
    assert store.get_many(["r1", "r2"]) == {}


def test_model_filter_is_applied() -> None:
    store = MemoryLoadStore()
    scraper = scrape_once(store, [("r1", "http://ok-3", "other")])
    assert store.get_many(["r1"]) == {}
    assert "model_name='other'" in (scraper.stats()["r1"].last_error or "")


def test_store_errors_are_counted() -> None:
    scraper = scrape_once(FailingStore(), [("r1", "http://ok-3", None)])
    assert scraper.stats()["r1"] == ScrapeStats(
        num_scrapes=1, num_failures=1, last_error="IndexUnavailableError: redis: down"
    )


def test_targets_are_read_every_round_and_stats_follow_them() -> None:
    store = MemoryLoadStore()
    rounds: list[list[ScrapeTarget]] = [
        [("r1", "http://ok-1", None), ("r2", "http://err", None)],
        [("r1", "http://ok-4", None), ("r3", "http://ok-2", None)],
    ]
    clock = iter([10.0, 20.0, 21.0])

    async def main() -> MetricsScraper:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            scraper = MetricsScraper(
                store, client, lambda: rounds.pop(0), clock=lambda: next(clock)
            )
            await scraper.scrape_once()
            await scraper.scrape_once()
            return scraper

    scraper = asyncio.run(main())
    assert set(scraper.stats()) == {"r1", "r3"}
    assert scraper.stats()["r1"].num_scrapes == 2
    assert {r: load.running for r, load in store.get_many(["r1", "r2", "r3"]).items()} == {
        "r1": 4.0,
        "r3": 2.0,
    }


def test_a_success_clears_last_error_and_keeps_counts() -> None:
    store = MemoryLoadStore()
    rounds: list[list[ScrapeTarget]] = [[("r1", "http://err", None)], [("r1", "http://ok-1", None)]]

    async def main() -> MetricsScraper:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            scraper = MetricsScraper(store, client, lambda: rounds.pop(0), clock=lambda: NOW)
            await scraper.scrape_once()
            await scraper.scrape_once()
            return scraper

    assert asyncio.run(main()).stats()["r1"] == ScrapeStats(2, 1, None, NOW)


def test_failing_targets_callable_skips_the_round() -> None:
    def targets() -> list[ScrapeTarget]:
        raise RuntimeError("registry unavailable")

    async def main() -> MetricsScraper:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            scraper = MetricsScraper(MemoryLoadStore(), client, targets)
            await scraper.scrape_once()
            return scraper

    assert asyncio.run(main()).stats() == {}


def test_start_twice_is_an_error_and_stop_is_idempotent() -> None:
    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            scraper = MetricsScraper(
                MemoryLoadStore(), client, list, interval_s=0.01, timeout_s=0.01
            )
            await scraper.stop()
            await scraper.start()
            with pytest.raises(RuntimeError, match="already running"):
                await scraper.start()
            await scraper.stop()
            await scraper.stop()
            assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())


@pytest.mark.parametrize(
    ("interval_s", "timeout_s"), [(0.0, 1.0), (1.0, 0.0), (-1.0, -2.0), (1.0, math.nan)]
)
def test_interval_and_timeout_must_be_positive(interval_s: float, timeout_s: float) -> None:
    client = httpx.AsyncClient()
    with pytest.raises(ValueError, match="must be > 0"):
        MetricsScraper(MemoryLoadStore(), client, list, interval_s=interval_s, timeout_s=timeout_s)
    asyncio.run(client.aclose())
