"""Probe benchmark: CPU per background GET, ``Probes`` (api/loop/probe.py) vs ``httpx.AsyncClient``.

Usage (from the repository root)::

    .venv/bin/python bench/probe.py                   # 2,000 GETs a client, 3 rounds
    .venv/bin/python bench/probe.py --gets 500 --rounds 1

A ``kvindex replica-sim`` on a free loopback port answers ``/health`` and ``/metrics`` (half
each); each client sends its GETs one at a time and then 16 at once (a round of checks), on
kept-alive connections, under uvloop as the proxy runs. The figure is this process's CPU time
(``time.process_time``) per GET: the server's CPU is not counted. Clients alternate each round.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import uvloop

from kvindex.api.loop.probe import Getter, Probes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.redis_server import free_ports


async def _cpu_per_get(getter: Getter, base: str, num_gets: int, at_once: int) -> float:
    async def get(path: str) -> None:
        answer = await getter.get(base + path, timeout=1.0)
        assert answer.status_code == 200 and answer.text is not None

    await asyncio.gather(*(get("/health") for _ in range(at_once)))  # connections opened
    start = time.process_time()
    for i in range(num_gets // at_once):
        path = "/health" if i % 2 else "/metrics"
        await asyncio.gather(*(get(path) for _ in range(at_once)))
    return (time.process_time() - start) / num_gets * 1e6


async def _round(base: str, num_gets: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for at_once in (1, 16):
        async with httpx.AsyncClient(trust_env=False) as client:
            out[f"httpx x{at_once}"] = await _cpu_per_get(client, base, num_gets, at_once)
            probes = Probes(client)
            out[f"probes x{at_once}"] = await _cpu_per_get(probes, base, num_gets, at_once)
            await probes.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gets", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    port, events = free_ports(2)
    kvindex = Path(sys.executable).with_name("kvindex")
    argv = [str(kvindex), "replica-sim", "--port", str(port), "--replay", ""]
    argv += ["--events", f"tcp://127.0.0.1:{events}", "--bind-events"]
    sim = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_up(base)
        for number in range(1, args.rounds + 1):
            figures = uvloop.run(_round(base, args.gets))
            line = ", ".join(f"{name} {us:.0f} us" for name, us in figures.items())
            print(f"round {number}: CPU per GET: {line}", flush=True)
    finally:
        sim.terminate()
        sim.wait(10)


def _wait_up(base: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the replica-sim at {base} never answered")


if __name__ == "__main__":
    main()
