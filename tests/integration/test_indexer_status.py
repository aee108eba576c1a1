"""``kvindex indexer`` as an operator runs it, scraped and probed on its status port.

A real process on the Redis store of a private redis-server (started and stopped here, so
it can be SIGSTOPped), a bound SUB fed by a real publisher, the status port on a free port
chosen by the OS and read from the log. Then Redis is stopped (SIGSTOP: it accepts
connections and never answers) and resumed.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvindex import __version__
from kvindex.clients.fake_vllm.publisher import EventPublisher
from kvindex.indexer.domain.events import BlockStored, Tier
from kvindex.indexer.metrics import COUNTERS
from tests.support.processes import running
from tests.support.redis_server import RedisServer, free_port, running_redis

KVINDEX = Path(sys.executable).parent / "kvindex"
MODEL = "demo-model"
TOKENS = list(range(700, 700 + 16 * 2))
STREAM = {"replica": "r1", "rank": "0", "model": MODEL}
_STATUS_LINE = re.compile(r"status port on http://127\.0\.0\.1:(\d+) ")

pytestmark = pytest.mark.timeout(60)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def until(check: Callable[[], object], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def status_url(log: Path) -> str:
    found: list[str] = []

    def logged() -> bool:
        found.extend(_STATUS_LINE.findall(log.read_text()))
        return bool(found)

    until(logged, "the status port in the log")
    return f"http://127.0.0.1:{found[0]}"


def scrape(http: httpx.Client) -> Samples:
    answer = http.get("/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(answer.text)
        for s in family.samples
    }


def timed(http: httpx.Client, path: str) -> tuple[int, float]:
    started = time.monotonic()
    status = http.get(path).status_code
    return status, time.monotonic() - started


@pytest.fixture
def redis_alone() -> Iterator[RedisServer]:
    """A redis-server of this test's own (the session's is shared: never stopped)."""
    with running_redis() as server:
        try:
            yield server
        finally:
            server.process.send_signal(signal.SIGCONT)  # a stopped server cannot exit


def test_the_indexer_status_port_exports_its_streams_and_tells_a_hung_store(
    redis_alone: RedisServer, tmp_path: Path
) -> None:
    events, log = f"tcp://127.0.0.1:{free_port()}", tmp_path / "indexer.log"
    args = ("--store", "redis", "--redis-url", redis_alone.url, "--bind", events)
    publisher = EventPublisher(events, topic=f"kv@r1@{MODEL}")
    try:
        with running(log, "indexer", *args, "--status-port", "0", "--stats-every", "0") as process:
            with httpx.Client(base_url=status_url(log), trust_env=False, timeout=1.0) as http:
                _scraped_while_indexing(http, publisher)
                _probed_while_redis_hangs(http, redis_alone)
            process.terminate()
            assert process.wait(timeout=10) == 0
    finally:
        publisher.close()


def _scraped_while_indexing(http: httpx.Client, publisher: EventPublisher) -> None:
    stream = frozenset(STREAM.items())

    def indexed() -> bool:
        publisher.publish([BlockStored((1, 2), None, TOKENS, 16, Tier.GPU)])
        return scrape(http).get(("kvindex_blocks", stream | {("tier", "gpu")}), 0) == 2

    until(indexed, "the published blocks in /metrics")  # the bound SUB is a slow joiner
    found = scrape(http)
    for series in COUNTERS:
        assert (f"kvindex_{series.name}_total", stream) in found, series.name
    assert found[("kvindex_batches_total", stream)] >= 1
    assert found[("kvindex_stream_block_size", stream)] == 16
    assert found[("kvindex_stream_connected", stream)] == 0  # bind mode: no socket of its own
    assert ("kvindex_stream_lag_seconds", stream) in found
    assert ("kvindex_stream_silent_seconds", stream) in found
    assert found[("kvindex_indexer_store_up", frozenset())] == 1
    build = frozenset({("version", __version__), ("component", "indexer")})
    assert found[("kvindex_build_info", build)] == 1
    # Partial when the slow joiner lost seq 0 (no replay endpoint to ask for it), else live.
    states = [found[("kvindex_streams", frozenset({("state", s)}))] for s in ("live", "partial")]
    assert sorted(states) == [0, 1]
    assert http.get("/healthz").json() == {"status": "ok"}
    assert http.get("/readyz").json() == {"status": "ready"}


def _probed_while_redis_hangs(http: httpx.Client, redis: RedisServer) -> None:
    redis.process.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        statuses: list[tuple[int, float]] = []
        while time.monotonic() - stopped < 2.0:
            statuses.append(timed(http, "/readyz"))
            if statuses[-1][0] == 503:
                break
        assert statuses[-1][0] == 503, statuses
        assert time.monotonic() - stopped <= 1.0 + 0.25, statuses  # probe period + timeout
        assert all(seconds < 1.0 for _, seconds in statuses), statuses
        reasons = http.get("/readyz").json()["reasons"]
        assert len(reasons) == 1 and reasons[0].startswith("store unreachable"), reasons
        health, seconds = timed(http, "/healthz")
        assert (health, seconds < 1.0) == (200, True)
        started = time.monotonic()
        assert scrape(http)[("kvindex_indexer_store_up", frozenset())] == 0
        assert time.monotonic() - started < 1.0
    finally:
        redis.process.send_signal(signal.SIGCONT)
    until(lambda: http.get("/readyz").status_code == 200, "ready again", timeout_s=5.0)
    assert scrape(http)[("kvindex_indexer_store_up", frozenset())] == 1


def test_a_status_port_in_use_stops_the_indexer_with_its_name(tmp_path: Path) -> None:
    port = free_port()
    with running(
        tmp_path / "first.log", "indexer", "--status-port", str(port), "--stats-every", "0"
    ):
        until(lambda: _STATUS_LINE.search((tmp_path / "first.log").read_text()), "first up")
        second = subprocess.run(
            [str(KVINDEX), "indexer", "--status-port", str(port)],
            capture_output=True,
            timeout=20,
            check=False,
        )
    assert second.returncode == 1
    assert f"status port 127.0.0.1:{port}" in second.stderr.decode()
    assert "Traceback" not in second.stderr.decode()
