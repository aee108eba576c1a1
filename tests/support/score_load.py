"""A small open-loop ``POST /score`` load, for outage tests and ``bench/sick_store.py``.

:func:`run_load` sends ``rate`` requests a second for ``duration_s`` seconds (each at its
planned time, whatever the earlier ones are doing, at most ``concurrency`` in flight) and
records every answer's latency, status and ``degraded`` reason; a request with no answer
within ``timeout_s`` is recorded with ``latency_s = None``. :func:`during` runs a load in
a thread while the caller injects a fault.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True, slots=True)
class Sample:
    sent_at: float
    """``time.monotonic()`` when the request was sent."""
    latency_s: float | None
    """None: no answer within the timeout (or the connection failed)."""
    status: int | None = None
    degraded: str | None = None


@dataclass
class LoadRun:
    samples: list[Sample] = field(default_factory=list)

    def between(self, start: float, end: float) -> list[Sample]:
        return [s for s in self.samples if start <= s.sent_at < end]


def summary(samples: list[Sample], within_s: float = 0.25) -> dict[str, Any]:
    """Counts and latencies of ``samples`` (JSON-ready)."""
    latencies = [s.latency_s for s in samples if s.latency_s is not None]
    fast = sum(1 for v in latencies if v <= within_s)
    return {
        "num_requests": len(samples),
        "num_answered": len(latencies),
        "num_degraded": sum(1 for s in samples if s.degraded is not None),
        "statuses": sorted({s.status for s in samples if s.status is not None}),
        "share_within_250ms": round(fast / len(samples), 4) if samples else None,
        "max_latency_s": round(max(latencies), 4) if latencies else None,
    }


async def _one(client: httpx.AsyncClient, body: dict[str, Any], timeout_s: float) -> Sample:
    sent = time.monotonic()
    try:
        response = await client.post("/score", json=body, timeout=timeout_s)
    except httpx.HTTPError:
        return Sample(sent, None)
    latency = time.monotonic() - sent
    degraded = response.json().get("degraded") if response.status_code == 200 else None
    return Sample(sent, latency, response.status_code, degraded)


async def _run(
    base_url: str,
    body: dict[str, Any],
    rate: float,
    duration_s: float,
    concurrency: int,
    timeout_s: float,
) -> list[Sample]:
    limits = httpx.Limits(max_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, trust_env=False) as client:

        async def paced(at: float) -> Sample:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            async with gate:
                return await _one(client, body, timeout_s)

        start = time.monotonic()
        count = round(rate * duration_s)
        return await asyncio.gather(*(paced(start + i / rate) for i in range(count)))


def run_load(
    base_url: str,
    body: dict[str, Any],
    *,
    rate: float = 50.0,
    duration_s: float = 1.0,
    concurrency: int = 8,
    timeout_s: float = 2.0,
) -> list[Sample]:
    """Send the load and wait for every answer (or its timeout)."""
    return asyncio.run(_run(base_url, body, rate, duration_s, concurrency, timeout_s))


@contextmanager
def during(base_url: str, body: dict[str, Any], **load: Any) -> Iterator[LoadRun]:
    """Run :func:`run_load` in a thread for the body of the ``with``; its samples are in the
    yielded run once the ``with`` ends (the exit waits for the load to finish)."""
    run = LoadRun()

    def work() -> None:
        run.samples = run_load(base_url, body, **load)

    thread = threading.Thread(target=work, name="score-load", daemon=True)
    thread.start()
    try:
        yield run
    finally:
        thread.join()
