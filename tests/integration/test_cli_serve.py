"""``kvindex serve`` as a user runs it: one process, in-process store, bound SUB, HTTP API."""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from redis.cluster import RedisCluster

from kvindex.clients.fake_vllm.publisher import EventPublisher
from kvindex.indexer.domain.events import BlockStored, Tier
from tests.support.processes import running
from tests.support.redis_cluster import ClusterNodes
from tests.support.redis_server import RedisServer, free_port

KVINDEX = Path(sys.executable).parent / "kvindex"
MODEL = "demo-model"
TOKENS = list(range(500, 500 + 16 * 4))

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    """(API base URL, bound events endpoint, log) of a running ``kvindex serve``."""
    events = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    log = tmp_path / "serve.log"
    with running(log, "serve", "--bind", events, "--port", str(port), "--stats-every", "0.2"):
        yield f"http://127.0.0.1:{port}", events, log


def status_lines(log: Path) -> list[str]:
    """The periodic status records of a log (one line each)."""
    return [line for line in log.read_text().splitlines() if " kvindex.status: " in line]


def _until(check: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if callable(check) and check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("timed out")


def _four_indexed(publishers: list[EventPublisher], http: httpx.Client) -> bool:
    """Each of the four replicas' publishers stores ``TOKENS`` once more; True when the
    API's answer shows every replica holding its four blocks."""
    for publisher in publishers:
        publisher.publish([BlockStored((1, 2, 3, 4), None, TOKENS, 16, Tier.GPU)])
    answer = http.post("/score", json={"model": MODEL, "token_ids": TOKENS})
    scores = answer.json()["scores"] if answer.status_code == 200 else []
    return len(scores) == 4 and all(s["matched_blocks"] == 4 for s in scores)


def test_serve_indexes_events_and_answers_score(serve: tuple[str, str, Path]) -> None:
    url, events, log = serve
    with httpx.Client(base_url=url, trust_env=False, timeout=5) as http:
        _until(lambda: http.get("/healthz").status_code == 200)
        publisher = EventPublisher(events, topic=f"kv@r1@{MODEL}")
        try:

            def indexed() -> bool:
                publisher.publish([BlockStored((1, 2, 3, 4), None, TOKENS, 16, Tier.GPU)])
                answer = http.post("/score", json={"model": MODEL, "token_ids": TOKENS})
                return (
                    answer.status_code == 200 and answer.json()["scores"][0]["matched_blocks"] == 4
                )

            _until(indexed)  # the bound SUB is a slow joiner: publish until it is seen
        finally:
            publisher.close()
        answer = http.post("/score", json={"model": MODEL, "token_ids": TOKENS}).json()
        assert answer["best"] == "r1"
        assert http.get("/readyz").status_code == 200
        assert http.get("/stats").json()["blocks"]["gpu"] == 4
    _until(lambda: any("blocks gpu 4 cpu 0 other 0" in line for line in status_lines(log)))
    line = status_lines(log)[-1]
    # Partial when the slow joiner lost seq 0 (no replay endpoint to ask for it), else live.
    state = "1 live" if " 1 live," in line else "0 live, 1 partial (r1/0)"
    assert f" INFO kvindex.status: 1 stream: {state}, 0 replaying, 0 stale · blocks gpu 4" in line
    assert "errors 0" in line and "batches/s" in line
    assert not any(box in log.read_text() for box in "┏│└")  # no table in the log


def test_indexer_logs_one_status_line_per_period(tmp_path: Path) -> None:
    events, log = f"tcp://127.0.0.1:{free_port()}", tmp_path / "indexer.log"
    publisher = EventPublisher(events, topic=f"kv@r1@{MODEL}")
    try:
        args = ("--bind", events, "--status-port", "0", "--stats-every", "0.2")
        with running(log, "indexer", *args):

            def indexed() -> bool:
                publisher.publish([BlockStored((1, 2), None, TOKENS[:32], 16, Tier.CPU)])
                return any("blocks gpu 0 cpu 2 other 0" in line for line in status_lines(log))

            _until(indexed)  # the bound SUB is a slow joiner: publish until it is seen
    finally:
        publisher.close()
    # Partial when the slow joiner lost seq 0 (no replay endpoint to ask for it), else live.
    shape = re.compile(
        r" INFO kvindex\.status: \d+ streams?: \d+ live, (\d+ partial \(r1/0\), )?\d+ replaying,"
        r" \d+ stale · blocks gpu \d+ cpu \d+ other \d+ · [\d.]+ batches/s · lag max \S+"
        r" · gaps \d+ · replays \d+ · restarts \d+ · errors \d+"
        r"( · partial r1/0 joined_without_replay for \d+s)?$"
    )
    lines = status_lines(log)
    assert all(shape.search(line) for line in lines), lines  # each record: one whole line
    states = ("1 live, ", "0 live, 1 partial (r1/0), ")
    totals = "0 replaying, 0 stale · blocks gpu 0 cpu 2 other 0"
    assert any(f"1 stream: {state}{totals}" in lines[-1] for state in states), lines[-1]


def test_serve_on_a_redis_cluster_given_one_node(
    redis_cluster: ClusterNodes, redis_cluster_client: RedisCluster, tmp_path: Path
) -> None:
    """Pointed at one node of a 3-master cluster, serve finds the others and its keys land
    on more than one master (before cluster support it exited with MovedError)."""
    events, port, log = f"tcp://127.0.0.1:{free_port()}", free_port(), tmp_path / "serve.log"
    url = redis_cluster.url.replace(str(redis_cluster.ports[0]), str(redis_cluster.ports[1]))
    args = ("serve", "--store", "redis", "--redis-url", url, "--bind", events)
    with (
        running(log, *args, "--port", str(port)) as process,
        httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=5) as http,
    ):
        _until(lambda: http.get("/readyz").status_code == 200)
        publishers = [EventPublisher(events, topic=f"kv@r{i}@{MODEL}") for i in range(4)]
        try:
            _until(lambda: _four_indexed(publishers, http))
        finally:
            for publisher in publishers:
                publisher.close()
        assert http.get("/stats").json()["blocks"]["gpu"] == 16
        assert process.poll() is None
    holding = [p for p, n in redis_cluster.num_keys_per_master().items() if n > 0]
    assert len(holding) > 1, redis_cluster.num_keys_per_master()
    assert "MovedError" not in log.read_text()


def test_api_takes_its_redis_url_from_env_and_its_token_from_a_file(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """On the session's Redis, flushed first (``redis_client``): an index left by an earlier
    test with another group count would rightly stop the API at start."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVINDEX_")}
    env["KVINDEX_REDIS_URL"] = redis_server.url
    port = free_port()
    args = ("api", "--port", str(port), "--token-file", str(token_file))
    with running(tmp_path / "api.log", *args, env=env) as process:
        base = f"http://127.0.0.1:{port}"
        _until(lambda: httpx.get(f"{base}/readyz").status_code == 200)
        assert httpx.get(f"{base}/stats").status_code == 401
        authorized = {"authorization": "Bearer s3cret"}
        assert httpx.get(f"{base}/stats", headers=authorized).status_code == 200
        assert process.poll() is None


def test_serve_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    """SIGTERM drains uvicorn, then the indexer and the store are stopped and the process
    exits 0 (uvicorn re-raised the signal once it had stopped: the process died of it,
    status -15, and nothing after uvicorn ran)."""
    port = free_port()
    args = ["serve", "--bind", f"tcp://127.0.0.1:{free_port()}", "--port", str(port)]
    with running(tmp_path / "serve.log", *args, "--stats-every", "0") as process:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False) as http:
            _until(lambda: http.get("/healthz").status_code == 200)
        process.terminate()
        assert process.wait(timeout=10) == 0
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


@pytest.mark.parametrize("workers", [1, 2])
def test_serve_in_connect_mode_with_ingest_workers(tmp_path: Path, workers: int) -> None:
    """``serve --ingest-workers N`` with four connect-mode replicas: every replica indexed
    through the workers' sockets, the workers' count in the log."""
    publishers = [EventPublisher("tcp://127.0.0.1:*", topic="") for _ in range(4)]
    replicas = [
        arg
        for i, pub in enumerate(publishers)
        for arg in ("--replica", f"id=r{i},model={MODEL},events={pub.endpoint}")
    ]
    port, log = free_port(), tmp_path / "serve.log"
    args = ("serve", *replicas, "--port", str(port), "--ingest-workers", str(workers))
    try:
        with (
            running(log, *args) as process,
            httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=5) as http,
        ):
            # each SUB is a slow joiner: publish until all are seen
            _until(lambda: _four_indexed(publishers, http))
            assert http.get("/stats").json()["blocks"]["gpu"] == 16
            assert process.poll() is None
    finally:
        for publisher in publishers:
            publisher.close()
    assert f"ingest workers: {workers}" in log.read_text()
