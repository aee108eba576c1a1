"""``kvindex serve`` as a user runs it: one process, in-process store, bound SUB, HTTP API."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvindex.clients.fake_vllm.publisher import EventPublisher
from kvindex.indexer.events import BlockStored, Tier
from tests.support.redis_server import free_port

KVINDEX = Path(sys.executable).parent / "kvindex"
MODEL = "demo-model"
TOKENS = list(range(500, 500 + 16 * 4))

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(API base URL, bound events endpoint) of a running ``kvindex serve``."""
    events = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    args = [str(KVINDEX), "serve", "--bind", events, "--port", str(port)]
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", events
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


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


def test_serve_indexes_events_and_answers_score(serve: tuple[str, str]) -> None:
    url, events = serve
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
