"""MetricsScraper over real HTTP on loopback: a good, a slow, a flaky and a dead replica.

Each replica is a tiny ``http.server`` in a background thread serving vLLM-style
``/metrics``; the fixtures start them on free ports and stop them (handler threads joined).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal

import httpx
import pytest

from kvindex.api.load.model import Load
from kvindex.api.load.scraper import MetricsScraper, ScrapeStats
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.load.vllm_metrics import KV_USAGE, RUNNING, WAITING
from tests.support.redis_server import free_port

Behaviour = Literal["good", "slow", "flaky"]

TIMEOUT_S = 0.4
"""The scraper's per-request timeout."""
SLOW_S = 30.0
"""How long the slow replica would take (it is released when its fixture stops)."""
FLAKY_OK = 2
"""Requests the flaky replica serves before it answers 500."""

METRICS = f"""\
# HELP {RUNNING} Number of requests in model execution batches.
# TYPE {RUNNING} gauge
{RUNNING}{{engine="0",model_name="m"}} 3.0
{RUNNING}{{engine="1",model_name="m"}} 1.0
# HELP {WAITING} Number of requests waiting to be processed.
# TYPE {WAITING} gauge
{WAITING}{{engine="0",model_name="m"}} 2.0
{WAITING}{{engine="1",model_name="m"}} 0.0
# HELP {KV_USAGE} KV-cache usage. 1 means 100 percent usage.
# TYPE {KV_USAGE} gauge
{KV_USAGE}{{engine="0",model_name="m"}} 0.25
{KV_USAGE}{{engine="1",model_name="m"}} 0.5
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} 5.0
vllm:e2e_request_latency_seconds_count{{engine="0",model_name="m"}} 5.0
vllm:e2e_request_latency_seconds_sum{{engine="0",model_name="m"}} 1.5
"""


class _Server(ThreadingHTTPServer):
    # Non-daemon handler threads, joined by server_close(): nothing outlives the fixture.
    daemon_threads = False
    block_on_close = True

    def __init__(self, behaviour: Behaviour) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.behaviour = behaviour
        self.released = threading.Event()
        self.num_requests = 0

    def handle_error(self, request: object, client_address: object) -> None:
        """The scraper hangs up on slow answers: expected, not worth a traceback."""


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        self.server.num_requests += 1
        if self.path != "/metrics":
            self._send(404, "not found")
        elif self.server.behaviour == "slow":
            self.server.released.wait(SLOW_S)
            with contextlib.suppress(OSError):  # the client is long gone
                self._send(200, METRICS)
        elif self.server.behaviour == "flaky" and self.server.num_requests > FLAKY_OK:
            self._send(500, "engine dead")
        else:
            self._send(200, METRICS)

    def _send(self, status: int, body: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet."""


@dataclass
class Replicas:
    """Base URLs of the running replicas, by behaviour, plus one nothing listens on."""

    servers: dict[Behaviour, _Server] = field(default_factory=dict)
    dead_url: str = ""

    def url(self, behaviour: Behaviour) -> str:
        return f"http://127.0.0.1:{self.servers[behaviour].server_address[1]}"

    def targets(self) -> list[tuple[str, str | None, str | None]]:
        return [
            ("good", self.url("good"), "m"),
            ("slow", self.url("slow"), "m"),
            ("flaky", self.url("flaky"), "m"),
            ("dead", self.dead_url, "m"),
            ("no-url", None, "m"),
        ]


@pytest.fixture
def replicas() -> Iterator[Replicas]:
    found = Replicas(dead_url=f"http://127.0.0.1:{free_port()}")
    threads = []
    for behaviour in ("good", "slow", "flaky"):
        server = found.servers[behaviour] = _Server(behaviour)
        threads.append(
            threading.Thread(
                target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
            )
        )
        threads[-1].start()
    yield found
    for server in found.servers.values():
        server.released.set()
        server.shutdown()
        server.server_close()
    for thread in threads:
        thread.join(timeout=5)


class TimedStore(MemoryLoadStore):
    """Remembers when (monotonic) each replica's load was first stored."""

    def __init__(self) -> None:
        super().__init__()
        self.first_put: dict[str, float] = {}

    def put(self, replica: str, load: Load) -> None:
        self.first_put.setdefault(replica, time.monotonic())
        super().put(replica, load)


def http_client() -> httpx.AsyncClient:
    # trust_env=False: no proxy from the environment, loopback traffic only.
    return httpx.AsyncClient(trust_env=False)


def test_one_round_is_bounded_by_the_timeout(replicas: Replicas) -> None:
    store = TimedStore()

    async def main() -> tuple[MetricsScraper, float, float]:
        async with http_client() as client:
            scraper = MetricsScraper(
                store, client, replicas.targets, interval_s=1.0, timeout_s=TIMEOUT_S
            )
            started = time.monotonic()
            await scraper.scrape_once()
            return scraper, started, time.monotonic() - started

    before = time.time()
    scraper, started, elapsed = asyncio.run(main())
    # The good replica was stored before the slow one's timeout fired ...
    assert store.first_put["good"] - started < TIMEOUT_S
    # ... and the round ended at that timeout, not when the slow replica answers.
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 2.0
    good = store.get_many(["good"])["good"]
    assert (good.running, good.waiting, good.kv_usage, good.source) == (4.0, 2.0, 0.5, "scrape")
    assert before <= good.ts <= time.time()
    stats = scraper.stats()
    assert set(stats) == {"good", "slow", "flaky", "dead"}
    assert stats["good"].num_failures == 0
    assert stats["slow"].last_error == f"timed out after {TIMEOUT_S:g} s"
    assert (stats["dead"].last_error or "").startswith("ConnectError")
    assert store.get_many(["slow", "dead", "no-url"]) == {}


async def _wait_until(predicate: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


def test_scraper_loop_counts_failures_and_stops_cleanly(replicas: Replicas) -> None:
    store = MemoryLoadStore()
    started = time.time()

    async def main() -> MetricsScraper:
        async with http_client() as client:
            scraper = MetricsScraper(
                store, client, replicas.targets, interval_s=TIMEOUT_S, timeout_s=TIMEOUT_S
            )
            await scraper.start()
            await _wait_until(lambda: scraper.stats().get("flaky", ScrapeStats()).num_failures >= 2)
            await scraper.stop()
            assert asyncio.all_tasks() == {asyncio.current_task()}
            return scraper

    stats = asyncio.run(main()).stats()
    good = store.get_many(["good"])["good"]
    assert good.source == "scrape"
    assert started <= good.ts <= time.time()
    # Rounds 1 to 3 are complete (flaky failed in rounds 3 and 4; round 4 may be partial).
    assert stats["good"].num_scrapes >= FLAKY_OK + 1
    assert stats["good"].num_failures == 0
    # stop() may cancel a round between storing a load and counting it: <=, not ==.
    assert stats["good"].last_success_ts is not None
    assert stats["good"].last_success_ts <= good.ts
    flaky = stats["flaky"]
    assert flaky.num_scrapes - flaky.num_failures == FLAKY_OK
    assert flaky.last_success_ts is not None
    assert flaky.last_error == f"GET {replicas.url('flaky')}/metrics: HTTP 500"
    # The flaky replica's last good load stays in the store, ageing.
    assert store.get_many(["flaky"])["flaky"].ts == flaky.last_success_ts
    for bad in ("slow", "dead"):
        assert stats[bad].num_failures == stats[bad].num_scrapes >= 2
        assert stats[bad].last_error is not None
        assert stats[bad].last_success_ts is None


def test_stop_during_a_slow_request(replicas: Replicas) -> None:
    async def main() -> None:
        async with http_client() as client:
            scraper = MetricsScraper(
                MemoryLoadStore(),
                client,
                lambda: [("slow", replicas.url("slow"), None)],
                interval_s=10.0,
                timeout_s=10.0,
            )
            await scraper.start()
            server = replicas.servers["slow"]
            await _wait_until(lambda: server.num_requests >= 1)
            begun = time.monotonic()
            await scraper.stop()
            assert time.monotonic() - begun < 1.0
            assert asyncio.all_tasks() == {asyncio.current_task()}
            assert scraper.stats() == {}

    asyncio.run(main())
