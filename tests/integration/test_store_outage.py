"""An API process (``runtime.open_stores``, as ``kvindex api`` builds it) on a private
redis-server that is killed (SIGKILL) or stopped (SIGSTOP) under a small ``/score`` load
(50 requests over 1 s, 8 in flight): every answer within 250 ms and ``degraded`` while it is
down, ``/healthz`` fast, ``/readyz`` 503 within a second; answers normal again once Redis is
back (restarted empty on the same port: the fleet is kept until the indexer republishes it,
never a 404). Plus a Redis that never answers a read from the start: a port that accepts
connections and stays silent, a wrong password.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvindex.api.config.settings import ApiSettings, ReadPathSettings
from kvindex.api.http.app import create_app
from kvindex.api.http.background import BackgroundServer
from kvindex.api.runtime import open_stores
from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.fleet.sync import FleetSync
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.redis.connection import connect
from kvindex.indexer.redis.schema import Schema
from tests.integration.api_harness import MODEL, Fleet, tokens
from tests.integration.harness import wait_until
from tests.support.redis_server import RedisServer, running_redis
from tests.support.score_load import Sample, during, run_load

pytestmark = [pytest.mark.redis_server, pytest.mark.latency_bound]

BUDGET_S = 0.25
"""Every answer while Redis is down: its usual latency plus the Redis timeout, well within."""
REDIS_TIMEOUT_S = ApiSettings().redis_timeout_s
PROMPT = tokens(0, 8)
BODY: dict[str, Any] = {"model": MODEL, "token_ids": PROMPT}
LOAD: dict[str, Any] = {"rate": 50.0, "duration_s": 1.0, "concurrency": 8, "timeout_s": 2.0}


@dataclass
class Outage:
    server: RedisServer
    sync: FleetSync
    """The indexer's fleet publisher (ticked by the test: when it republishes is known)."""
    base_url: str

    def get(self, path: str) -> tuple[int, float]:
        started = time.monotonic()
        response = httpx.get(f"{self.base_url}{path}", timeout=5.0, trust_env=False)
        return response.status_code, time.monotonic() - started

    def answer(self) -> Sample:
        (sample,) = run_load(self.base_url, BODY, rate=100.0, duration_s=0.01)
        return sample


@pytest.fixture
def outage() -> Iterator[Outage]:
    with running_redis() as server:
        writer = connect(server.url, socket_timeout_s=1.0)
        fleet = Fleet.over(RedisIndex(writer, Schema()))
        fleet.add("r1", "r2")
        fleet.store("r2", PROMPT)
        sync = FleetSync(writer, Schema(), fleet.registry)
        sync.tick()
        settings = IndexerSettings(store="redis", redis_url=server.url)
        deps = open_stores(ReadPathSettings(settings, ApiSettings(scrape_interval_s=0.0)))
        try:
            with BackgroundServer(create_app(deps)) as http:
                yield Outage(server, sync, http.base_url)
        finally:
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGCONT)
            deps.index.close()
            writer.close()


def usual_latency(api: Outage) -> float:
    """The slowest answer of the same load with Redis up: on a host that other work slows
    down (the load, the API and the checks share one process and two cores), the usual
    latency the bound adds the Redis timeout to."""
    samples = run_load(api.base_url, BODY, **LOAD)
    assert all(s.status == 200 and s.degraded is None for s in samples)
    return max(s.latency_s or 9.9 for s in samples)


def budget(usual_s: float) -> float:
    """:data:`BUDGET_S`, or the usual latency plus the Redis timeout (and 50 ms) when the
    host makes that longer."""
    return max(BUDGET_S, usual_s + REDIS_TIMEOUT_S + 0.05)


def _assert_bounded_and_degraded(samples: list[Sample], usual_s: float) -> None:
    assert len(samples) == 50
    limit = budget(usual_s)
    slow = [s.latency_s for s in samples if s.latency_s is None or s.latency_s > limit]
    assert slow == [], f"{len(slow)} of 50 answers later than {limit:.3f} s: {slow[:5]}"
    assert {s.status for s in samples} == {200}
    assert all(s.degraded is not None for s in samples)


def _check_health_while_down(api: Outage) -> None:
    """/healthz answers at once and /readyz says 503 within a second, under the load."""
    for _ in range(3):
        status, took = api.get("/healthz")
        assert (status, took < BUDGET_S) == (200, True), took
        status, took = api.get("/readyz")
        assert (status, took < 1.0) == (503, True), took
        time.sleep(0.2)


def _normal(api: Outage) -> bool:
    sample = api.answer()
    return sample.status == 200 and sample.degraded is None


def test_redis_killed_under_load_answers_degraded_in_time_then_recovers(outage: Outage) -> None:
    assert _normal(outage)
    usual_s = usual_latency(outage)
    outage.server.process.kill()  # SIGKILL
    outage.server.process.wait()
    with during(outage.base_url, BODY, **LOAD) as run:
        _check_health_while_down(outage)
    _assert_bounded_and_degraded(run.samples, usual_s)
    outage.server.restart()  # same port, empty: the fleet hash is gone until the next sync
    samples = run_load(outage.base_url, BODY, **{**LOAD, "duration_s": 0.6})
    assert {s.status for s in samples} == {200}  # never "unknown model" around the restart
    assert max(s.latency_s or 9.9 for s in samples) <= BUDGET_S
    wait_until(lambda: outage.get("/readyz")[0] == 200, timeout_s=3.0, what="ready")
    wait_until(lambda: outage.answer().degraded is not None, timeout_s=3.0, what="fleet lost")
    outage.sync.tick()  # the indexer republishes the fleet
    wait_until(lambda: _normal(outage), timeout_s=3.0, what="normal answers")


def test_redis_stopped_under_load_answers_degraded_in_time_then_recovers(outage: Outage) -> None:
    assert _normal(outage)
    usual_s = usual_latency(outage)
    outage.server.process.send_signal(signal.SIGSTOP)  # accepts connections, never answers
    try:
        with during(outage.base_url, BODY, **LOAD) as run:
            _check_health_while_down(outage)
    finally:
        outage.server.process.send_signal(signal.SIGCONT)
    _assert_bounded_and_degraded(run.samples, usual_s)
    wait_until(lambda: _normal(outage), timeout_s=3.0, what="normal answers")
    assert (outage.answer().latency_s or 9.9) <= BUDGET_S


@pytest.fixture
def silent_url() -> Iterator[str]:
    """A loopback port that accepts connections and never says a word."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"


def _unreadable_from_the_start(url: str) -> None:
    """An API whose Redis never answers a read: prompt 200 degraded answers, /readyz 503."""
    settings = IndexerSettings(store="redis", redis_url=url)
    deps = open_stores(ReadPathSettings(settings, ApiSettings(scrape_interval_s=0.0)))
    try:
        with BackgroundServer(create_app(deps)) as http:
            samples = run_load(http.base_url, BODY, **{**LOAD, "duration_s": 0.4})
            started = time.monotonic()
            ready = httpx.get(f"{http.base_url}/readyz", timeout=5.0, trust_env=False)
            assert (ready.status_code, time.monotonic() - started < 1.0) == (503, True)
    finally:
        deps.index.close()
    assert {s.status for s in samples} == {200}  # not 404 "known models: []"
    assert max(s.latency_s or 9.9 for s in samples) <= BUDGET_S
    assert all(s.degraded is not None and "fleet" in s.degraded for s in samples)


def test_a_store_silent_from_the_start_gives_prompt_degraded_answers(silent_url: str) -> None:
    _unreadable_from_the_start(silent_url)


def test_a_wrong_redis_password_gives_degraded_answers_not_unknown_model() -> None:
    with running_redis() as server:
        admin = server.client()
        admin.config_set("requirepass", "secret")  # this private server only
        admin.close()
        _unreadable_from_the_start(f"redis://:wrong@127.0.0.1:{server.port}/0")
