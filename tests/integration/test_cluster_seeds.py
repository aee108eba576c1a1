"""An API on a Redis Cluster reached from several seed URLs: a dead first seed costs
nothing when another answers, and an API started while no seed answers runs degraded
(``/readyz`` 503, ``kvindex_api_store_up`` 0, a log line) and joins the cluster once one
does, in cluster mode ``auto`` (several seeds) and ``on`` (where it used to exit)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.processes import running
from tests.support.redis_cluster import ClusterNodes
from tests.support.redis_server import free_port

pytestmark = pytest.mark.timeout(60)


@contextmanager
def api(url: str, mode: str, log: Path) -> Iterator[httpx.Client]:
    """``kvindex api`` on ``url`` in cluster mode ``mode``, up (``/healthz``)."""
    port = free_port()
    args = ("api", "--port", str(port))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVINDEX_")}
    env |= {"KVINDEX_STORE": "redis", "KVINDEX_REDIS_URL": url, "KVINDEX_REDIS_CLUSTER": mode}
    with (
        running(log, *args, env=env) as process,
        httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=5) as http,
    ):
        _until(lambda: _status(http, "/healthz") == 200, process.poll, log)
        yield http


def _status(http: httpx.Client, path: str) -> int | None:
    try:
        return http.get(path).status_code
    except httpx.TransportError:
        return None


def _until(
    check: Callable[[], bool], exited: Callable[[], int | None], log: Path, timeout_s: float = 20.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert exited() is None, f"the API exited: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"not in {timeout_s} s: {log.read_text()[-2000:]}"
        time.sleep(0.1)


def _ready_and_working(http: httpx.Client, log: Path) -> None:
    _until(lambda: _status(http, "/readyz") == 200, lambda: None, log)
    spec = {"id": "seeded", "model": "m"}
    assert http.post("/replicas", json=spec).status_code in (200, 201)
    assert any(r["id"] == "seeded" for r in http.get("/replicas").json())
    http.delete("/replicas/seeded")


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_an_api_whose_first_seed_is_dead_is_ready_through_the_next(
    redis_cluster: ClusterNodes, tmp_path: Path, mode: str
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0,{redis_cluster.url}"
    log = tmp_path / "api.log"
    with api(url, mode, log) as http:
        _ready_and_working(http, log)


@pytest.mark.parametrize(
    ("mode", "dead_seeds"), [("on", 0), ("auto", 1)], ids=["on-one-seed", "auto-two-seeds"]
)
def test_an_api_started_while_no_seed_answers_joins_once_one_does(
    redis_cluster: ClusterNodes, tmp_path: Path, mode: str, dead_seeds: int
) -> None:
    seed = redis_cluster.processes[0]
    url = ",".join([f"redis://127.0.0.1:{free_port()}/0"] * dead_seeds + [redis_cluster.url])
    log = tmp_path / "api.log"
    seed.send_signal(signal.SIGSTOP)  # answers nothing (well within its node timeout)
    try:
        with api(url, mode, log) as http:
            assert _status(http, "/readyz") == 503
            metrics = http.get("/metrics").text
            assert "kvindex_api_store_up 0.0" in metrics, metrics
            seed.send_signal(signal.SIGCONT)
            since = time.monotonic()
            _ready_and_working(http, log)
            print(f"\nready {time.monotonic() - since:.2f} s after its seed answered")
            assert "no seed answers" in log.read_text()
    finally:
        seed.send_signal(signal.SIGCONT)
