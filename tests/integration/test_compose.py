"""compose.yaml, run without Docker: the SAME commands it declares, as local processes
(``.venv/bin/kvindex ...``), with only hosts and ports rewritten to 127.0.0.1 and free
ports, and the Redis URL to the private redis-server of ``tests/conftest.py`` (or to one
node of its 3-master Redis Cluster: the same commands run on it unchanged).

Every kvindex service's healthcheck (the image's probe, run here with this interpreter)
passes once the processes are up. Completions on a simulator → the indexer process → Redis
→ ``POST /score`` on the API process names that simulator, and the proxy process sends
the same prompt (through the real ``openai`` package) to it; ``POST``/``DELETE /replicas``
on the API process reach the indexer process (it opens the new replica's stream; it stops
indexing a deleted one).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest
import yaml

from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.redis.connection import RedisClient
from kvindex.indexer.redis.schema import Schema
from tests.support.redis_cluster import ClusterNodes
from tests.support.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]
KVINDEX = Path(sys.executable).parent / "kvindex"
MODEL = "demo-model"
PROMPT = " ".join(f"word{i}" for i in range(80))
_URL = re.compile(r"(?P<scheme>tcp|http|redis)://(?P<host>[^:/\s,]+):(?P<port>\d+)")

pytestmark = pytest.mark.timeout(120)


def compose_file() -> dict[str, Any]:
    with (ROOT / "compose.yaml").open() as file:
        loaded: dict[str, Any] = yaml.safe_load(file)
    return loaded


def compose_services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = compose_file()["services"]
    return services


@dataclass
class Rewriter:
    """(service, container port) → a free loopback port; ``redis`` → the test's server."""

    redis_url: str
    ports: dict[tuple[str, int], int]

    def port(self, service: str, port: int) -> int:
        """The loopback port given to ``service``'s ``port``: free now, and none given before
        (two calls of ``free_port`` may return the same port: it is only free, not held)."""
        if (service, port) not in self.ports:
            taken = set(self.ports.values())
            chosen = free_port()
            while chosen in taken:
                chosen = free_port()
            self.ports[service, port] = chosen
        return self.ports[service, port]

    def command(self, service: str, args: list[Any]) -> list[str]:
        out: list[str] = []
        for i, arg in enumerate(str(a) for a in args):
            option = str(args[i - 1]) if i else ""
            if option == "--host":
                out.append("127.0.0.1")
            elif option in ("--port", "--status-port"):
                out.append(str(self.port(service, int(arg))))
            else:
                out.append(_URL.sub(lambda m: self._url(service, m), arg))
        return out

    def _url(self, service: str, match: re.Match[str]) -> str:
        scheme, host, port = match["scheme"], match["host"], int(match["port"])
        if scheme == "redis":
            return self.redis_url.removesuffix("/0")
        owner = service if host in ("*", "0.0.0.0") else host  # a bind here, else a peer
        return f"{scheme}://127.0.0.1:{self.port(owner, port)}"


@dataclass
class Fleet:
    rewriter: Rewriter
    http: httpx.Client
    """To the API process."""
    index: RedisIndex
    schema: Schema

    def sim_url(self, service: str) -> str:
        return f"http://127.0.0.1:{self.rewriter.port(service, 8001)}"


@contextmanager
def processes(commands: dict[str, list[str]], logs: Path) -> Iterator[None]:
    started: list[subprocess.Popen[bytes]] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVINDEX_")}
    try:
        for name, args in commands.items():
            with (logs / f"{name}.log").open("wb") as log:
                started.append(
                    subprocess.Popen(
                        [str(KVINDEX), *args], stdout=log, stderr=subprocess.STDOUT, env=env
                    )
                )
        yield
    finally:
        for process in started:
            process.terminate()
        for process in started:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_for(predicate: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _store(request: pytest.FixtureRequest) -> tuple[str, RedisClient]:
    """The URL of an emptied store (standalone unless the test asks for ``cluster``), and a
    client of its own to look into it."""
    if getattr(request, "param", "redis") == "cluster":
        request.getfixturevalue("redis_cluster_client")  # flushes every master
        cluster: ClusterNodes = request.getfixturevalue("redis_cluster")
        return cluster.url, cluster.client()
    request.getfixturevalue("redis_client")  # flushes the server
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.url, server.client()


@pytest.fixture
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fleet]:
    url, client = _store(request)
    rewriter = Rewriter(url, {})
    commands = {
        name: rewriter.command(name, service["command"])
        for name, service in compose_services().items()
        if "build" in service  # kvindex's own: the test's redis-server stands in for redis
    }
    with (
        processes(commands, tmp_path),
        httpx.Client(
            base_url=f"http://127.0.0.1:{rewriter.port('api', 8000)}", timeout=10, trust_env=False
        ) as http,
    ):
        schema = Schema()
        index = RedisIndex(client, schema)
        fleet = Fleet(rewriter, http, index, schema)
        try:
            wait_for(lambda: http.get("/readyz").status_code == 200, "the api process")
            for sim in ("sim1", "sim2", "sim3"):
                url = fleet.sim_url(sim)
                wait_for(lambda u=url: httpx.get(f"{u}/health").status_code == 200, sim)
            wait_for(lambda: connected(http) == {"r1", "r2", "r3"}, "streams connected")
            status = f"http://127.0.0.1:{rewriter.port('indexer', 8090)}"
            wait_for(lambda: httpx.get(f"{status}/readyz").status_code == 200, "indexer ready")
            yield fleet
        finally:
            index.close()


def connected(http: httpx.Client) -> set[str]:
    """Replicas the API process sees with a connected stream (as the indexer reports)."""
    views = http.get("/replicas").json()
    return {v["id"] for v in views if any(s["connected"] for s in v["streams"])}


def complete(fleet: Fleet, sim: str) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    response = httpx.post(f"{fleet.sim_url(sim)}/v1/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text


def score(fleet: Fleet) -> dict[str, Any]:
    response = fleet.http.post("/score", json={"model": MODEL, "prompt": PROMPT})
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def matched(answer: dict[str, Any]) -> dict[str, int]:
    return {s["replica"]: s["matched_blocks"] for s in answer["scores"]}


def status_fields(fleet: Fleet) -> set[str]:
    keys = cast("list[bytes]", fleet.index.client.hkeys(fleet.schema.stream_status))
    return {k.decode() for k in keys}


@pytest.mark.parametrize("fleet", ["redis", "cluster"], indirect=True)
def test_compose_commands_route_by_cache(fleet: Fleet) -> None:
    complete(fleet, "sim2")
    wait_for(lambda: matched(score(fleet)).get("r2", 0) > 0, "r2's blocks in the index")
    answer = score(fleet)
    assert answer["best"] == "r2"
    assert matched(answer)["r2"] > 0
    assert matched(answer)["r1"] == matched(answer)["r3"] == 0


def test_replica_changes_on_the_api_reach_the_indexer(fleet: Fleet) -> None:
    spare = f"tcp://127.0.0.1:{free_port()}"  # nothing listens: the stream just exists
    added = fleet.http.post("/replicas", json={"id": "r4", "model": MODEL, "events": spare})
    assert added.status_code == 201, added.text
    # Only the indexer writes stream status: r4/0 appears once its registry has r4.
    wait_for(lambda: "r4/0" in status_fields(fleet), "the indexer to open r4")

    complete(fleet, "sim2")
    wait_for(lambda: matched(score(fleet)).get("r2", 0) > 0, "r2's blocks in the index")
    assert fleet.http.delete("/replicas/r2").status_code == 200
    wait_for(lambda: "r2/0" not in status_fields(fleet), "the indexer to drop r2")
    assert StreamId("r2") not in fleet.index.streams()
    # sim2 keeps publishing, but the indexer has closed its stream: nothing comes back.
    complete(fleet, "sim2")
    time.sleep(1.5)
    assert StreamId("r2") not in fleet.index.streams()
    assert "r2" not in matched(score(fleet))


def test_the_proxy_service_sends_a_prompt_to_the_replica_holding_it(fleet: Fleet) -> None:
    proxy = f"http://127.0.0.1:{fleet.rewriter.port('proxy', 8080)}"
    wait_for(lambda: httpx.get(f"{proxy}/readyz").status_code == 200, "the proxy process")
    complete(fleet, "sim2")
    wait_for(lambda: matched(score(fleet)).get("r2", 0) > 0, "r2's blocks in the index")
    client = openai.OpenAI(
        base_url=f"{proxy}/v1",
        api_key="unused",
        max_retries=0,
        http_client=openai.DefaultHttpxClient(trust_env=False),
    )
    with client:
        assert [m.id for m in client.models.list().data] == [MODEL]
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    answer = raw.parse()
    assert raw.headers["x-kvindex-replica"] == "r2"
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    assert answer.usage.prompt_tokens_details.cached_tokens  # r2 held it: a cache hit


def probe(url: str) -> int:
    """The exit status of the kvindex services' healthcheck command run against ``url``."""
    command = compose_file()["x-kvindex-healthcheck"]["test"]
    assert command[:2] == ["CMD", "python"]
    env = {**os.environ, "HEALTHCHECK_URL": url}
    return subprocess.run([sys.executable, *command[2:]], env=env, check=False).returncode


def test_every_healthcheck_passes_once_the_fleet_is_up(fleet: Fleet) -> None:
    for name, service in compose_services().items():
        if "build" not in service:
            continue
        found = re.fullmatch(
            r"http://127\.0\.0\.1:(\d+)(/\w+)", service["environment"]["HEALTHCHECK_URL"]
        )
        assert found is not None, name
        url = f"http://127.0.0.1:{fleet.rewriter.port(name, int(found[1]))}{found[2]}"
        wait_for(lambda u=url: probe(u) == 0, f"{name}'s healthcheck")
    assert probe(f"http://127.0.0.1:{free_port()}/readyz") != 0  # nothing listens there
