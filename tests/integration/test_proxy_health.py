"""Health through ``kvindex proxy``: the real ``openai`` package → the proxy (a subprocess,
memory store) → three ``kvindex replica-sim``s. A replica killed is ejected and never chosen
again until it passes its health checks; restarted on the same ports, it is restored."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import redis

from kvindex.indexer.fleet.replica_health import ReplicaHealth
from kvindex.indexer.redis.schema import Schema
from tests.support.processes import Child, http_ok, kvindex_child
from tests.support.redis_server import RedisServer, free_port

MODEL = "demo-model"
VICTIM = "r3"
"""Not r1, whose /tokenize the proxy asks: while r1 is down and not yet ejected, prompts
are routed on load alone (tested with /score: tests/integration/test_score_health.py)."""
pytestmark = pytest.mark.timeout(90)
CONFIG = """
[api]
health_check_interval_s = 0.2
health_check_timeout_s = 0.5
unhealthy_threshold = 3
healthy_threshold = 2
breaker_failures = 2
breaker_cooldown_s = 1.0
"""


@dataclass
class Fleet:
    sims: dict[str, Child]
    proxy: Child
    port: int

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.port}/metrics", trust_env=False).text

    def gauge(self) -> float:
        found = re.search(r"^kvindex_proxy_ejected_replicas (\S+)$", self.metrics(), re.M)
        assert found is not None
        return float(found.group(1))

    def connect_errors(self, replica: str) -> float:
        pattern = (
            rf'^kvindex_proxy_upstream_errors_total{{kind="connect",replica="{replica}"}} (\S+)$'
        )
        found = re.search(pattern, self.metrics(), re.M)
        return 0.0 if found is None else float(found.group(1))

    def until(self, what: str, condition: object, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if callable(condition) and condition():
                return
            time.sleep(0.05)
        raise AssertionError(f"{what} not within {timeout_s} s: {self.proxy.tail()}")


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    config = tmp_path / "kvindex.toml"
    config.write_text(CONFIG)
    with ExitStack() as stack:
        sims: dict[str, Child] = {}
        specs: list[str] = []
        for rid in ("r1", "r2", "r3"):
            http_port, events_port = free_port(), free_port()
            args = [
                "replica-sim", "--id", rid, "--model", MODEL, "--port", str(http_port),
                "--events", f"tcp://127.0.0.1:{events_port}", "--bind-events", "--replay", "",
                "--speed", "1000", "--seed", "7",
            ]  # fmt: skip
            ready = http_ok(http_port, "/health")
            sims[rid] = kvindex_child(f"sim {rid}", args, tmp_path / f"{rid}.log", ready)
            stack.callback(sims[rid].stop)
            sims[rid].spawn()
            events = f"tcp://127.0.0.1:{events_port}"
            specs.append(f"id={rid},model={MODEL},url=http://127.0.0.1:{http_port},events={events}")
        for sim in sims.values():
            sim.wait_ready(40)
        port = free_port()
        args = ["--log-format", "json", "proxy", "--port", str(port), "--config", str(config)]
        for spec in specs:
            args += ["--replica", spec]
        proxy = kvindex_child("proxy", args, tmp_path / "proxy.log", http_ok(port, "/readyz"))
        stack.callback(proxy.stop)
        proxy.start(40)
        yield Fleet(sims, proxy, port)


def _client(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{fleet.port}/v1",
        api_key="unused",
        max_retries=0,
        timeout=20,
        http_client=openai.DefaultHttpxClient(trust_env=False),
    )


def _answer(client: openai.OpenAI, n: int) -> tuple[str, float]:
    """(the replica that answered a fresh prompt, when the answer ended)."""
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=f"question {n} " + "word " * 20, max_tokens=1
    )
    return raw.headers["x-kvindex-replica"], time.time()


def _logged(fleet: Fleet, message: str) -> float:
    """The time (unix seconds) of the proxy's first log line with ``message``."""
    for line in fleet.proxy.log.read_text().splitlines():
        record = json.loads(line) if line.startswith("{") else {}
        if message in record.get("message", ""):
            return datetime.fromisoformat(record["ts"]).timestamp()
    raise AssertionError(f"no log line {message!r}: {fleet.proxy.tail()}")


def test_a_killed_replica_is_ejected_and_restored_after_passing_checks(fleet: Fleet) -> None:
    with _client(fleet) as client:
        answered = {_answer(client, n)[0] for n in range(12)}
        assert VICTIM in answered, answered  # a healthy fleet: every replica takes some
        fleet.sims[VICTIM].kill()
        fleet.until("the victim ejected", lambda: fleet.gauge() == 1.0)
        metrics = fleet.metrics()
        assert re.search(
            rf'kvindex_proxy_ejections_total{{reason="\w+",replica="{VICTIM}"}}', metrics
        )
        tried = fleet.connect_errors(VICTIM)
        for n in range(100, 120):  # every answer from the others, and the victim never tried
            assert _answer(client, n)[0] != VICTIM
        assert fleet.connect_errors(VICTIM) == tried
        fleet.sims[VICTIM].start(40)  # the same ports
        fleet.until("the victim restored", lambda: fleet.gauge() == 0.0)
        restored = _logged(fleet, f"replica {VICTIM} restored")
        # Passing its checks is not all: until the subscriber's next reconnect attempt (its
        # back-off reaches reconnect_max_s, 5 s) the victim's events stream is still down, so
        # it stays out of routing a little longer.
        back: list[float] = []
        deadline, n = time.monotonic() + 15.0, 200
        while len(back) < 2 and time.monotonic() < deadline:
            replica, ended = _answer(client, n)
            n += 1
            if replica == VICTIM:
                back.append(ended)
            else:
                time.sleep(0.05)
        assert back, "the restored replica never took a request again"
        assert all(ended > restored for ended in back)


@pytest.mark.redis_server
def test_proxies_and_the_api_on_one_redis_agree_on_an_ejection(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Two proxies and a ``kvindex api`` next to one indexer: a killed replica is ejected
    once, in the one record they all read, and each of them leaves it out."""
    config = tmp_path / "kvindex.toml"
    config.write_text(CONFIG)
    store = ["--store", "redis", "--redis-url", redis_server.url]
    with ExitStack() as stack:
        sims = {rid: _sim_child(rid, tmp_path) for rid in ("r1", "r2", "r3")}
        for child, _ in sims.values():
            stack.callback(child.stop)
            child.start(40)
        args = ["indexer", *store, "--status-port", "-1", "--stats-every", "0"]
        for _, spec in sims.values():
            args += ["--replica", spec]
        indexer = kvindex_child("indexer", args, tmp_path / "indexer.log", lambda: True)
        stack.callback(indexer.stop)
        indexer.spawn()
        proxies = []
        for number in range(2):
            port = free_port()
            command = ["proxy", "--port", str(port), *store, "--config", str(config)]
            log = tmp_path / f"proxy{number}.log"
            child = kvindex_child(f"proxy {number}", command, log, http_ok(port, "/readyz"))
            stack.callback(child.stop)
            child.start(40)
            proxies.append(Fleet({}, child, port))
        api_port = free_port()
        command = ["api", "--port", str(api_port), "--redis-url", redis_server.url]
        api = kvindex_child(
            "api",
            [*command, "--config", str(config)],
            tmp_path / "api.log",
            http_ok(api_port, "/readyz"),
        )
        stack.callback(api.stop)
        api.start(40)
        sims[VICTIM][0].kill()
        for proxy in proxies:
            proxy.until("the victim ejected", lambda p=proxy: p.gauge() == 1.0)
        with httpx.Client(base_url=f"http://127.0.0.1:{api_port}", trust_env=False) as http:
            body = {"model": MODEL, "prompt": "a b c", "dry_run": True}
            # The API reads the fleet through a cache (half a second): ask until it has seen it.
            deadline = time.monotonic() + 10.0
            answer = http.post("/score", json=body).json()
            while VICTIM not in answer["unhealthy"] and time.monotonic() < deadline:
                time.sleep(0.1)
                answer = http.post("/score", json=body).json()
        assert answer["unhealthy"][VICTIM].startswith("ejected: ")
        assert answer["best"] != VICTIM and answer["degraded"] is None
        raw = redis_client.hget(Schema().replica_health, VICTIM)
        assert isinstance(raw, bytes)
        record = msgspec.json.decode(raw, type=ReplicaHealth)
        assert record.check_ejected and record.num_ejections == 1  # judged once, shared
        for proxy in proxies:
            with _client(proxy) as client:
                assert {_answer(client, n)[0] for n in range(6)} <= {"r1", "r2"}


def _sim_child(rid: str, tmp_path: Path) -> tuple[Child, str]:
    http_port, events_port = free_port(), free_port()
    args = [
        "replica-sim", "--id", rid, "--model", MODEL, "--port", str(http_port),
        "--events", f"tcp://127.0.0.1:{events_port}", "--bind-events", "--replay", "",
        "--speed", "1000",
    ]  # fmt: skip
    child = kvindex_child(
        f"sim {rid}", args, tmp_path / f"{rid}.log", http_ok(http_port, "/health")
    )
    events = f"tcp://127.0.0.1:{events_port}"
    return child, f"id={rid},model={MODEL},url=http://127.0.0.1:{http_port},events={events}"
