"""bench/fixed_upstream.py answers as the proxy reads a replica: a chat completion whole or
streamed, vLLM's load gauges, a health check; on every port it was given, kept alive; and
an events publisher listens where one was asked for."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from kvindex.api.load.vllm_metrics import parse_vllm_metrics
from tests.support.paths import ROOT
from tests.support.redis_server import free_port


@pytest.fixture
def ports() -> Iterator[list[int]]:
    # The answering ports, then the events port of the last.
    ports = [free_port(), free_port(), free_port()]
    script = ROOT / "bench" / "fixed_upstream.py"
    specs = [str(ports[0]), f"{ports[1]},{ports[2]}"]
    server = subprocess.Popen([sys.executable, str(script), "m", *specs])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{ports[1]}/health", trust_env=False)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        yield ports
    finally:
        server.terminate()
        server.wait(10)


def test_each_port_answers_a_chat_whole_streamed_load_and_health(ports: list[int]) -> None:
    for port in ports[:2]:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False) as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            for _ in range(2):  # one connection, kept alive
                whole = http.post("/v1/chat/completions", json=body)
                assert whole.json()["choices"][0]["message"]["content"]
            streamed = http.post("/v1/chat/completions", json={**body, "stream": True})
            assert streamed.headers["transfer-encoding"] == "chunked"
            assert streamed.text.count("data: ") == 7 and streamed.text.endswith("[DONE]\n\n")
            load = parse_vllm_metrics(http.get("/metrics").text, now=1.0, model="m")
            assert (load.running, load.waiting, load.kv_usage) == (0.0, 0.0, 0.0)
            assert http.get("/health").status_code == 200


def test_an_events_port_has_a_publisher_listening(ports: list[int]) -> None:
    with socket.create_connection(("127.0.0.1", ports[2]), timeout=5):
        pass  # a subscriber's connection is taken: its stream shows connected
