"""``/score`` of ``kvindex serve`` (a subprocess) over two ``kvindex replica-sim``s: it no
longer names a replica whose events endpoint is dead, whose health checks fail, or that was
killed while it held the prompt, when another candidate is live."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from kvindex.clients.cli.main import main
from kvindex.clients.fake_vllm.tokenizer import (
    tokenize_text,
)
from tests.support.processes import Child, http_ok, kvindex_child
from tests.support.redis_server import free_port

MODEL = "demo-model"
PROMPT = " ".join(f"tide{i}" for i in range(40))
"""Two whole blocks of 16 tokens in the replica simulator's toy tokenizer."""
TOKENS = tokenize_text(PROMPT)
pytestmark = pytest.mark.timeout(90)
CONFIG = """
[api]
health_check_interval_s = 0.2
health_check_timeout_s = 0.5
unhealthy_threshold = 3
events_down_after_s = 1.0
"""


@dataclass
class Served:
    sims: dict[str, Child]
    urls: dict[str, str]
    events: dict[str, str]
    http: httpx.Client

    def score(self) -> dict[str, Any]:
        body = {"model": MODEL, "token_ids": TOKENS, "dry_run": True, "top_k": 0}
        answer: dict[str, Any] = self.http.post("/score", json=body).raise_for_status().json()
        return answer

    def until(self, what: str, condition: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        deadline = time.monotonic() + 20
        answer = self.score()
        while not condition(answer):
            assert time.monotonic() < deadline, f"{what}: last answer {answer}"
            time.sleep(0.05)
            answer = self.score()
        return answer


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    config = tmp_path / "kvindex.toml"
    config.write_text(CONFIG)
    with ExitStack() as stack:
        sims: dict[str, Child] = {}
        urls: dict[str, str] = {}
        events: dict[str, str] = {}
        for rid in ("r1", "r2"):
            http_port, events_port = free_port(), free_port()
            urls[rid], events[rid] = (
                f"http://127.0.0.1:{http_port}",
                f"tcp://127.0.0.1:{events_port}",
            )
            args = [
                "replica-sim", "--id", rid, "--model", MODEL, "--port", str(http_port),
                "--events", events[rid], "--bind-events", "--replay", "", "--speed", "1000",
            ]  # fmt: skip
            ready = http_ok(http_port, "/health")
            sims[rid] = kvindex_child(f"sim {rid}", args, tmp_path / f"{rid}.log", ready)
            stack.callback(sims[rid].stop)
            sims[rid].start(40)
        port = free_port()
        args = ["serve", "--port", str(port), "--config", str(config)]
        for rid in sims:
            args += ["--replica", f"id={rid},model={MODEL},url={urls[rid]},events={events[rid]}"]
        serve = kvindex_child("serve", args, tmp_path / "serve.log", http_ok(port, "/readyz"))
        stack.callback(serve.stop)
        serve.start(40)
        http = stack.enter_context(
            httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=10)
        )
        yield Served(sims, urls, events, http)


def _holding(served: Served, replica: str) -> None:
    """``replica`` computes the prompt, and the index hears of its blocks."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    httpx.post(f"{served.urls[replica]}/v1/completions", json=body, trust_env=False, timeout=10)
    served.until(f"{replica} best", lambda a: a["best"] == replica and a["num_matched"] == 1)


def _add(served: Served, **spec: str) -> None:
    served.http.post("/replicas", json={"model": MODEL, **spec}).raise_for_status()


def test_a_replica_with_a_dead_events_endpoint_is_never_best(served: Served) -> None:
    _add(served, id="dead", events=f"tcp://127.0.0.1:{free_port()}")
    answer = served.until("dead judged", lambda a: "dead" in a["unhealthy"])
    assert answer["unhealthy"]["dead"] == "events stream never connected"
    for _ in range(8):  # with no load it had no penalty: it was best in 5 of 8
        answer = served.score()
        assert answer["best"] in ("r1", "r2") and answer["degraded"] is None
        assert "dead" not in [e["replica"] for e in answer["scores"]]


def test_a_replica_failing_its_health_checks_is_never_best(served: Served) -> None:
    _holding(served, "r2")
    # Its events are r2's (live, so it holds the prompt too); its url is dead.
    _add(served, id="nohealth", events=served.events["r2"], url=f"http://127.0.0.1:{free_port()}")
    # Until its events connection is seen (a second on a loaded host), it may read unhealthy
    # for that first: wait for the ejection itself.
    answer = served.until(
        "nohealth ejected", lambda a: a["unhealthy"].get("nohealth", "").startswith("ejected: ")
    )
    assert answer["unhealthy"]["nohealth"].startswith("ejected: ")
    assert "failed health checks" in answer["unhealthy"]["nohealth"]
    for _ in range(8):
        assert served.score()["best"] == "r2"
    replicas = served.http.get("/replicas").json()
    [view] = [v for v in replicas if v["id"] == "nohealth"]
    assert view["health"]["state"] == "ejected" and view["health"]["check_failures"] >= 3


def test_a_killed_replica_holding_the_prompt_stops_being_best(served: Served) -> None:
    _holding(served, "r1")
    served.sims["r1"].kill()
    answer = served.until("r1 left out", lambda a: a["best"] == "r2")
    assert "r1" in answer["unhealthy"] and answer["degraded"] is None
    # By text: tokenized by the first replica's /tokenize, r1's until it is ejected.
    url = str(served.http.base_url).rstrip("/")
    args = ["residency", "--url", url, "--model", MODEL, "--text", PROMPT]
    deadline = time.monotonic() + 20
    result = CliRunner().invoke(main, args)
    while result.exit_code != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "★ r2" in result.output and "left out, unhealthy: r1 (" in result.output
    assert "· 40 tokens ·" in result.output  # tokenized: by r2, r1 being ejected
    served.sims["r2"].kill()  # every candidate unhealthy: an honest, degraded answer
    answer = served.until("none healthy", lambda a: a["degraded"] is not None)
    assert answer["degraded"].startswith("no healthy candidate, every one ranked")
    assert set(answer["unhealthy"]) == {"r1", "r2"} and answer["best"] in ("r1", "r2")
