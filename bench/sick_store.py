"""``kvindex api`` under a sick Redis: answers while Redis is killed (SIGKILL) or stopped
(SIGSTOP) under an open-loop ``/score`` load.

The API runs as its own process (``kvindex api``, as in production) on a private
redis-server that an in-process fleet (the tests' harness, published by a ``FleetSync``
ticking as an indexer's does) fills. The load runs ``--seconds``; the fault starts after
1 s and ends (Redis restarted empty on its port, or continued) 2 s before the load does.
Prints one JSON line: the answers sent while Redis was down and those sent from 1 s after
it was back, each summarised (answered, share within 250 ms, max latency, degraded), and
the slowest ``/healthz`` while it was down.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from machine import calibration_ms, host_load
from redis_server import free_port

from kvindex.indexer.fleet.sync import FleetSync
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.redis.connection import connect
from kvindex.indexer.redis.schema import Schema
from tests.integration.api_harness import MODEL, Fleet, tokens
from tests.support.redis_server import running_redis
from tests.support.score_load import during, summary

KVINDEX = Path(sys.executable).parent / "kvindex"


def _wait_http(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=0.5, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer")


def _healthz_latencies(base: str, seconds: float) -> list[float]:
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        try:
            httpx.get(f"{base}/healthz", timeout=5.0, trust_env=False)
            out.append(time.monotonic() - started)
        except httpx.HTTPError:
            out.append(5.0)
        time.sleep(0.2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fault", choices=["kill", "stop"], default="kill")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    calibration = calibration_ms()
    with running_redis() as server, tempfile.TemporaryDirectory() as tmp:
        schema = Schema()
        client = connect(server.url)
        fleet = Fleet.over(RedisIndex(client, schema))
        fleet.add("r1", "r2", "r3", "r4")
        fleet.store("r2", tokens(0, 8))
        sync = FleetSync(client, schema, fleet.registry, period_s=1.0)
        sync.start()
        config = Path(tmp) / "api.toml"
        config.write_text("[api]\nscrape_interval_s = 0\n")
        port = free_port()
        api = subprocess.Popen(
            [
                str(KVINDEX),
                "api",
                "--redis-url",
                server.url,
                "--port",
                str(port),
                "--config",
                str(config),
            ],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        base = f"http://127.0.0.1:{port}"
        try:
            _wait_http(f"{base}/healthz")
            body = {"model": MODEL, "token_ids": tokens(0, 8)}
            load = {
                "rate": args.rate,
                "duration_s": args.seconds,
                "concurrency": args.concurrency,
                "timeout_s": 2.0,
            }
            with during(base, body, **load) as run:
                time.sleep(1.0)
                down_at = time.monotonic()
                if args.fault == "kill":
                    server.process.kill()
                else:
                    server.process.send_signal(signal.SIGSTOP)
                health = _healthz_latencies(base, args.seconds - 3.0)
                up_at = time.monotonic()
                if args.fault == "kill":
                    server.restart()
                else:
                    server.process.send_signal(signal.SIGCONT)
            line = {
                "bench": "sick_store",
                "fault": args.fault,
                "rate": args.rate,
                "down": summary(run.between(down_at, up_at)),
                "after": summary(run.between(up_at + 1.0, float("inf"))),
                "healthz_max_s": round(max(health), 4) if health else None,
                "calibration_ms": calibration,
                "host_load": host_load(),
            }
            print(json.dumps(line))
        finally:
            api.terminate()
            api.wait(10)
            sync.stop()
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGCONT)
            client.close()


if __name__ == "__main__":
    main()
