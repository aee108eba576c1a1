"""Start-up benchmark: ``kvindex serve`` from its command to a ready ``GET /readyz``.

Usage (from the repository root)::

    .venv/bin/python bench/startup.py                             # this checkout, 9 starts
    .venv/bin/python bench/startup.py --kvindex .venv/bin/kvindex --kvindex OLD/.venv/bin/kvindex

Each start runs ``kvindex serve`` on a free loopback port with an empty fleet (memory store)
and polls ``GET /readyz`` every 5 ms until it answers 200; the process is then stopped
(SIGTERM). Measured per start: ``ready_s`` (wall time from the spawn to that answer),
``cpu_s`` (the process's user + system time by then: less exposed than wall time to a busy
host) and ``rss_mib`` (its resident memory by then). With several ``--kvindex``, the starts
alternate between them (the order reversed every other round), so a drift of the host's
load spreads over all.
Output: one JSON line per start on stdout, then one summary line per binary (medians and
minimums); nothing else on stdout.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

_POLL_S = 0.005
_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def ready(port: int) -> bool:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", "/readyz")
        response = connection.getresponse()
        response.read()
        return response.status == 200
    except OSError:
        return False
    finally:
        connection.close()


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start_once(kvindex: str) -> dict[str, Any]:
    """One start of ``kvindex serve``: its time, CPU and memory when ``/readyz`` says ready."""
    port = free_port()
    command = [kvindex, "serve", "--host", "127.0.0.1", "--port", str(port)]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not ready(port):
            if process.poll() is not None:
                raise RuntimeError(f"{kvindex} serve exited with {process.returncode}")
            if time.perf_counter() - started > _TIMEOUT_S:
                raise RuntimeError(f"{kvindex} serve not ready in {_TIMEOUT_S:.0f} s")
            time.sleep(_POLL_S)
        ready_s = time.perf_counter() - started
        return {
            "kvindex": kvindex,
            "ready_s": round(ready_s, 3),
            "cpu_s": round(cpu_s(process.pid), 3),
            "rss_mib": round(rss_mib(process.pid), 1),
        }
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def summary(kvindex: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"summary": "startup", "kvindex": kvindex, "starts": len(runs)}
    for key in ("ready_s", "cpu_s", "rss_mib"):
        values = [run[key] for run in runs]
        out[f"{key}_median"] = round(statistics.median(values), 3)
        out[f"{key}_min"] = round(min(values), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--kvindex", action="append", help="a kvindex command (repeatable; default .venv's)"
    )
    parser.add_argument("--starts", type=int, default=9, help="starts per kvindex")
    args = parser.parse_args()
    binaries: list[str] = args.kvindex or [".venv/bin/kvindex"]
    runs: dict[str, list[dict[str, Any]]] = {b: [] for b in binaries}
    for i in range(args.starts):
        for kvindex in binaries if i % 2 == 0 else binaries[::-1]:
            run = start_once(kvindex)
            runs[kvindex].append(run)
            print(json.dumps(run), flush=True)
    for kvindex in binaries:
        print(json.dumps(summary(kvindex, runs[kvindex])), flush=True)


if __name__ == "__main__":
    main()
