"""The processes' logs and settings as an operator sets them: ``--log-format json``, the
access log, ``KVINDEX_API_*`` variables (``kvindex serve`` and ``kvindex api`` as
subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.processes import running
from tests.support.redis_server import free_port, running_redis

KVINDEX = Path(sys.executable).parent / "kvindex"

pytestmark = pytest.mark.timeout(60)


def wait_healthy(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered /healthz")


def json_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of a log, each of which must be one JSON object."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return [json.loads(line) for line in lines]


def test_serve_logs_json_lines_with_the_access_log_and_status_fields(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["serve", "--log-format", "json", "--port", str(port), "--access-log"]
    env = {"KVINDEX_API_SCRAPE_INTERVAL_S": "0", "KVINDEX_LOG_REPEAT_S": "10"}
    with running(
        stderr := tmp_path / "stderr.log",
        *args,
        "--stats-every",
        "0.2",
        env={**os.environ, **env},
        stdout=False,
    ):
        wait_healthy(url)
        httpx.delete(f"{url}/replicas/nobody", timeout=5.0, trust_env=False)
        time.sleep(0.5)  # a status line or two
    entries = json_lines(stderr)  # fails on any line that is not JSON
    assert all({"ts", "level", "logger", "message"} <= set(e) for e in entries)
    access = [e for e in entries if e["logger"] == "kvindex.access"]
    deleted = [e for e in access if e["method"] == "DELETE"]
    assert [(e["route"], e["status"], e["path"]) for e in deleted] == [
        ("/replicas/{replica_id}", 404, "/replicas/nobody")
    ]
    assert any(e["route"] == "/healthz" and e["status"] == 200 for e in access)
    status = [e for e in entries if e["logger"] == "kvindex.status"]
    assert status and all(e["num_streams"] == 0 and "blocks_by_tier" in e for e in status)


@pytest.mark.redis_server
def test_api_takes_its_settings_from_the_environment(tmp_path: Path) -> None:
    """``kvindex api`` with its port, Redis timeout and access log from ``KVINDEX_API_*``;
    it runs no write path, so its /metrics has none of the fleet's write-path series."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running_redis() as redis_server:
        env = {
            "KVINDEX_REDIS_URL": redis_server.url,
            "KVINDEX_API_PORT": str(port),
            "KVINDEX_API_SCRAPE_INTERVAL_S": "0",
            "KVINDEX_API_ACCESS_LOG": "false",
        }
        with running(
            stderr := tmp_path / "stderr.log", "api", env={**os.environ, **env}, stdout=False
        ):
            wait_healthy(url)
            text = httpx.get(f"{url}/metrics", timeout=5.0, trust_env=False).text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    assert "kvindex_api_store_up" in names
    assert 'kvindex_build_info{component="api"' in text
    assert not names & {"kvindex_batches_total", "kvindex_blocks", "kvindex_replicas"}
    assert "kvindex.access" not in stderr.read_text()


def test_a_bad_api_variable_is_named_at_start(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(KVINDEX), "serve", "--port", str(free_port())],
        env={**os.environ, "KVINDEX_API_SCRAPE_TIMEOUT_S": "fast"},
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert result.returncode != 0
    assert b"KVINDEX_API_SCRAPE_TIMEOUT_S must be a number, got 'fast'" in result.stderr
