"""``kvindex proxy`` as an operator sees into it, black box: what a failed request tells the
client (its id) and the log (the detail), ``/readyz`` with every replica dead, each
ejection logged, the access log by flag, config key and variable, the index, stream and
build series on ``/metrics``, and ``kvindex replicas`` / ``kvindex stats`` pointed at the
proxy. Every part is a real process on free loopback ports: ``kvindex replica-sim``s and
the proxy (memory store, its own subscriber)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.processes import KVINDEX, Child, http_ok, kvindex_child
from tests.support.redis_server import free_port

MODEL = "demo-model"
TOKEN = "operator-token"
CLIENT_SECRET = "client-secret-never-logged"
# Health checks fast enough that a dead replica is ejected within a second.
FAST_CHECKS = "[api]\nhealth_check_interval_s = 0.2\nhealth_check_timeout_s = 0.2\n"
pytestmark = pytest.mark.timeout(90)


@dataclass
class Fleet:
    sims: dict[str, Child]
    proxy: Child
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def chat(self, request_id: str, token: str = TOKEN) -> httpx.Response:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "word " * 40}],
            "max_tokens": 2,
        }
        headers = {"x-request-id": request_id, "authorization": f"Bearer {token}"}
        url = f"{self.url}/v1/chat/completions"
        return httpx.post(url, json=body, headers=headers, timeout=30, trust_env=False)

    def kill_all(self) -> None:
        for sim in self.sims.values():
            sim.kill()

    def log_lines(self) -> list[str]:
        return self.proxy.log.read_text(errors="replace").splitlines()


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def _fleet(
    stack: ExitStack,
    workdir: Path,
    replica_ids: tuple[str, ...],
    proxy_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    name: str = "proxy",
) -> Fleet:
    """Replica-sims ``replica_ids`` and a proxy in front of them (``proxy_args``, ``env``)."""
    specs, sims = [], {}
    for rid in replica_ids:
        http_port, events = free_port(), f"tcp://127.0.0.1:{free_port()}"
        args = [
            "replica-sim", "--id", rid, "--model", MODEL, "--port", str(http_port),
            "--events", events, "--bind-events", "--replay", "", "--speed", "1000",
        ]  # fmt: skip
        sim = kvindex_child(
            f"sim {rid}", args, workdir / f"{name}-{rid}.log", http_ok(http_port, "/health")
        )
        stack.callback(sim.stop)
        sim.spawn()
        sims[rid] = sim
        specs.append(f"id={rid},model={MODEL},url=http://127.0.0.1:{http_port},events={events}")
    for sim in sims.values():
        sim.wait_ready(40)
    port = free_port()
    args = ["proxy", "--port", str(port), *proxy_args]
    for spec in specs:
        args += ["--replica", spec]
    proxy = kvindex_child(name, args, workdir / f"{name}.log", http_ok(port, "/readyz"))
    proxy.env = env or {}
    stack.callback(proxy.stop)
    proxy.start(40)
    return Fleet(sims, proxy, port)


def _until(check: Callable[[], Any], what: str, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_failed_request_gives_the_client_its_id_and_the_log_the_replicas_and_reasons(
    stack: ExitStack, tmp_path: Path
) -> None:
    fleet = _fleet(stack, tmp_path, ("r1", "r2"))
    fleet.kill_all()
    answer = fleet.chat("probe-502")
    assert answer.status_code == 502, answer.text
    assert "127.0.0.1" not in answer.text and "Error(" not in answer.text, answer.text
    error = answer.json()["error"]
    assert error["request_id"] == answer.headers["x-request-id"] == "probe-502", answer.text
    lines = _until(
        lambda: [line for line in fleet.log_lines() if "probe-502: 502:" in line], "the log line"
    )
    assert len(lines) == 1, lines
    assert "kvindex.proxy" in lines[0], lines
    assert "r1: connect" in lines[0] and "r2: connect" in lines[0], lines
    retries = [line for line in fleet.log_lines() if "probe-502: retry on replica" in line]
    assert len(retries) == 1, fleet.log_lines()


def test_readyz_is_503_once_every_replica_is_dead_and_says_why(
    stack: ExitStack, tmp_path: Path
) -> None:
    config = tmp_path / "kvindex.toml"
    config.write_text(FAST_CHECKS)
    fleet = _fleet(stack, tmp_path, ("r1", "r2"), ("--config", str(config)))
    ready = f"{fleet.url}/readyz"
    assert httpx.get(ready, trust_env=False).status_code == 200
    fleet.kill_all()
    answer = _until(
        lambda: (r := httpx.get(ready, trust_env=False)).status_code == 503 and r,
        "/readyz to answer 503",
    )
    detail = answer.json()["detail"]
    assert "out of routing" in detail and "r1" in detail and "r2" in detail, detail


def test_the_ejections_of_different_replicas_are_each_logged(
    stack: ExitStack, tmp_path: Path
) -> None:
    config = tmp_path / "kvindex.toml"
    config.write_text(FAST_CHECKS)
    ids = ("r1", "r2", "r3")
    fleet = _fleet(stack, tmp_path, ids, ("--config", str(config)))
    fleet.kill_all()

    def ejected() -> set[str]:
        lines = [line for line in fleet.log_lines() if "ejected" in line]
        return {rid for rid in ids for line in lines if re.search(rf"\b{rid}\b", line)}

    _until(lambda: ejected() == set(ids), "an ejection line of every replica", 15.0)


ACCESS_WAYS = {
    "flag": (("--access-log",), {}, ""),
    "config key": ((), {}, "[api]\naccess_log = true\n"),
    "env var": ((), {"KVINDEX_API_ACCESS_LOG": "true"}, ""),
}


@pytest.mark.parametrize("way", ACCESS_WAYS)
def test_the_access_log_is_on_by_flag_config_key_or_env_var_with_every_field(
    stack: ExitStack, tmp_path: Path, way: str
) -> None:
    args, env, table = ACCESS_WAYS[way]
    config = tmp_path / "kvindex.toml"
    config.write_text(table)
    env = {**env, "KVINDEX_LOG_FORMAT": "json"}
    fleet = _fleet(stack, tmp_path, ("r1",), ("--config", str(config), *args), env=env)
    assert fleet.chat("probe-access", token=CLIENT_SECRET).status_code == 200

    def access_line() -> dict[str, Any] | None:
        for line in fleet.log_lines():
            if line.startswith("{") and '"kvindex.access"' in line:
                entry: dict[str, Any] = json.loads(line)
                if entry.get("request_id") == "probe-access":
                    return entry
        return None

    entry = _until(access_line, "the access-log line")
    assert entry["method"] == "POST" and entry["route"] == "/v1/chat/completions", entry
    assert (entry["replica"], entry["status"], entry["retries"]) == ("r1", 200, 0), entry
    assert 0 < entry["ttfb_ms"] <= entry["duration_ms"], entry
    assert "matched_fraction" in entry, entry
    assert CLIENT_SECRET not in fleet.proxy.log.read_text()


def _kvindex(*args: str) -> subprocess.CompletedProcess[str]:
    command = [str(KVINDEX), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)


def _guarded_fleet(stack: ExitStack, workdir: Path) -> Fleet:
    """Two replica-sims behind a proxy asking for TOKEN, after one answered request."""
    config = workdir / "kvindex.toml"
    config.write_text(f'[proxy]\nauth_token = "{TOKEN}"\n')
    fleet = _fleet(stack, workdir, ("r1", "r2"), ("--config", str(config)))
    assert fleet.chat("probe-metrics").status_code == 200
    return fleet


def test_the_proxy_metrics_have_its_build_index_and_stream_series(
    stack: ExitStack, tmp_path: Path
) -> None:
    fleet = _guarded_fleet(stack, tmp_path)
    auth = {"authorization": f"Bearer {TOKEN}"}
    page = httpx.get(f"{fleet.url}/metrics", headers=auth, trust_env=False).text
    assert re.search(r'kvindex_build_info\{component="proxy",version="[^"]+"\} 1', page), (
        "no build info"
    )
    for series in (
        'kvindex_stream_connected{model="demo-model",rank="0",replica="r1"} 1.0',
        "kvindex_blocks{",
        'kvindex_streams{state="live"}',
        "kvindex_batches_total{",
        "kvindex_replicas 2.0",
        "kvindex_lookup_seconds_count",
        "kvindex_proxy_requests_total{",
    ):
        assert series in page, series


def test_kvindex_replicas_and_stats_read_the_proxy_with_its_token(
    stack: ExitStack, tmp_path: Path
) -> None:
    fleet = _guarded_fleet(stack, tmp_path)
    replicas = _kvindex("replicas", "--url", fleet.url, "--token", TOKEN, "--json")
    assert replicas.returncode == 0, replicas.stderr
    assert [r["id"] for r in json.loads(replicas.stdout)] == ["r1", "r2"]
    stats = _kvindex("stats", "--url", fleet.url, "--token", TOKEN, "--json")
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["replicas"] == 2
    table = _kvindex("replicas", "--url", fleet.url, "--token", TOKEN)
    assert table.returncode == 0 and "r2" in table.stdout, table.stderr
    refused = _kvindex("stats", "--url", fleet.url, "--token", "wrong")
    assert refused.returncode != 0 and "401" in refused.stderr + refused.stdout
