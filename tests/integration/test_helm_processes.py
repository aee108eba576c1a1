"""The Helm chart's containers run as local processes: each Deployment's arguments and
environment exactly as Helm renders them (tests/unit/test_helm_chart.py), with only what a
kubelet would fill in done here — the Secrets' values, the pod's name, the settings file from
its ConfigMap — and every listen address 0.0.0.0 made 127.0.0.1. On the test's redis-server, in
front of one replica-sim, every liveness, readiness and startup probe the chart declares then
passes against the live process (HTTP routes and the picker's gRPC health), and the API
process, fed by the indexer process, scores the replica: the probes name real health routes
and the commands run as written."""

from __future__ import annotations

import base64
import re
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.processes import Child, http_ok, kvindex_child
from tests.support.redis_server import RedisServer, free_ports
from tests.unit.test_helm_chart import containers, one, render

MODEL = "demo-model"
CONFIG_PATH = "/etc/kvindex/kvindex.toml"
pytestmark = pytest.mark.timeout(120)


def _env(container: dict[str, Any], docs: list[dict[str, Any]], pod: str) -> dict[str, str]:
    """The container's variables as the kubelet sets them ($(NAME) expanded, Secrets read)."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), var["value"])
        elif "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            value = base64.b64decode(one(docs, "Secret", ref["name"])["data"][ref["key"]]).decode()
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            value = pod
        env[var["name"]] = "127.0.0.1" if value == "0.0.0.0" else value
    return env


def _args(container: dict[str, Any], config: Path) -> list[str]:
    return [
        "127.0.0.1" if arg == "0.0.0.0" else str(config) if arg == CONFIG_PATH else arg
        for arg in container["args"]
    ]


def _probe(container: dict[str, Any], probe: dict[str, Any]) -> Callable[[], bool]:
    """A probe's check, run against 127.0.0.1 (a named port resolved as the kubelet does)."""
    by_name = {p["name"]: p["containerPort"] for p in container["ports"]}
    if "grpc" in probe:
        return _grpc_serving(probe["grpc"]["port"], probe["grpc"]["service"])
    port = probe["httpGet"]["port"]
    return http_ok(by_name.get(port, port), probe["httpGet"]["path"])


def _grpc_serving(port: int, service: str) -> Callable[[], bool]:
    def check() -> bool:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
            except grpc.RpcError:
                return False
            return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

    return check


def _until(check: Callable[[], bool], what: str, child: Child, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        assert child.running, f"{child.name} exited: {child.tail()}"
        time.sleep(0.1)
    raise AssertionError(f"{what} never passed: {child.tail()}")


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[str]:
    """One replica-sim; yields its --replica spec."""
    http_port, events, replay = free_ports(3)
    args = [
        "replica-sim", "--id", "r1", "--model", MODEL, "--port", str(http_port),
        "--events", f"tcp://127.0.0.1:{events}", "--bind-events",
        "--replay", f"tcp://127.0.0.1:{replay}", "--speed", "1000", "--seed", "7",
    ]  # fmt: skip
    child = kvindex_child("sim", args, tmp_path / "sim.log", http_ok(http_port, "/health"))
    child.start()
    try:
        yield (
            f"id=r1,model={MODEL},url=http://127.0.0.1:{http_port},"
            f"events=tcp://127.0.0.1:{events},replay=tcp://127.0.0.1:{replay}"
        )
    finally:
        child.stop()


def test_rendered_containers_pass_their_probes(
    redis_server: RedisServer, redis_client: object, sim: str, tmp_path: Path
) -> None:
    api, status, grpc_port, metrics, proxy = free_ports(5)
    docs = render({
        "replicas": [sim],
        "redis": {"enabled": False, "externalUrl": redis_server.url},
        "config": f'[[models]]\nname = "{MODEL}"\nblock_size = 16\n',
        "indexer": {"replicas": 1, "statusPort": status},
        "api": {"port": api},
        "picker": {"port": grpc_port, "metricsPort": metrics},
        "proxy": {"enabled": True, "port": proxy},
    })  # fmt: skip
    config = tmp_path / "kvindex.toml"
    config.write_text(one(docs, "ConfigMap", "kvindex")["data"]["kvindex.toml"])
    with ExitStack() as stack:
        running = []
        for deployment, container in containers(docs):
            args = _args(container, config)
            child = kvindex_child(deployment, args, tmp_path / f"{deployment}.log", lambda: True)
            child.env = _env(container, docs, f"{deployment}-0")
            child.spawn()
            stack.callback(child.stop)
            running.append((child, container))
        for child, container in running:
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                _until(_probe(container, container[kind]), f"{child.name} {kind}", child)
        [api_child] = [c for c, _ in running if c.name == "kvindex-api"]
        body = {"model": MODEL, "prompt": "hello " * 40}
        _until(lambda: _scores_r1(api, body), "the API scoring the replica", api_child)


def _scores_r1(port: int, body: dict[str, Any]) -> bool:
    answer = httpx.post(f"http://127.0.0.1:{port}/score", json=body, timeout=5, trust_env=False)
    return answer.status_code == 200 and answer.json().get("best") == "r1"
