"""Faults of a replica behind ``kvindex proxy``, seen by its clients: four ``kvindex
replica-sim``s behind a real proxy, 20 requests a second (half streamed) the whole run.

One replica is stopped (SIGSTOP: the kernel still accepts, nothing answers) for 10 s: no
client sees an error, and none waits longer than the hang bound over its normal latency.
Then another is killed (SIGKILL): only streams already under way on it are cut (the body
ends without its end, as HTTP/1.1 says it), and no request that had no byte yet fails.
"""

from __future__ import annotations

import asyncio
import signal
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvindex.api.config.settings import ApiSettings
from kvindex.clients.proxy.settings import ProxySettings
from tests.integration.test_proxy_forwarding import MODEL, Proxy, Sims, _start

pytestmark = [pytest.mark.faults, pytest.mark.timeout(90)]

RATE = 20.0
"""Requests a second, every other one streamed."""
STOPPED, KILLED = "r1", "r2"
STREAM_STALL_S = 0.5
"""The killed replica's streams pause this long after their first chunk (so some are under
way when it dies); its streams' normal latency includes it."""
SLACK_S = 0.5
"""Scheduling noise on a shared test machine, over the bound and the normal latency."""


def hang_bound_s() -> float:
    """The stated bound: the sooner of the checks' ejection and the passive probe's."""
    api, proxy = ApiSettings(), ProxySettings()
    checks = api.unhealthy_threshold * api.health_check_interval_s + api.health_check_timeout_s
    passive = 1.5 * proxy.hang_silence_s + api.health_check_timeout_s
    return min(checks, passive)


@dataclass
class Outcome:
    number: int
    streamed: bool
    started: float
    latency_s: float
    replica: str | None
    error: str | None
    """None: a whole answer; ``cut``: a stream whose body broke off; else what failed."""


@dataclass
class Load:
    """The clients: a request every 1/RATE s, each on its own task, every outcome kept."""

    base_url: str
    outcomes: list[Outcome]

    async def run(self, until: asyncio.Event) -> None:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(
            base_url=self.base_url, timeout=60, trust_env=False, limits=limits
        ) as client:
            tasks, number = [], 0
            start = time.monotonic()
            while not until.is_set():
                tasks.append(asyncio.ensure_future(self._one(client, number)))
                number += 1
                await asyncio.sleep(max(0.0, start + number / RATE - time.monotonic()))
            await asyncio.gather(*tasks)

    async def _one(self, client: httpx.AsyncClient, number: int) -> None:
        streamed = number % 2 == 0
        words = " ".join(f"t{number % 37}w{i}" for i in range(40))
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": words}],
            "max_tokens": 4,
            "stream": streamed,
        }
        started = time.monotonic()
        replica, error = None, None
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                replica = response.headers.get("x-kvindex-replica")
                if response.status_code != 200:
                    error = f"status {response.status_code}"
                else:
                    error = await _read(response, streamed)
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        latency = time.monotonic() - started
        self.outcomes.append(Outcome(number, streamed, started, latency, replica, error))


async def _read(response: httpx.Response, streamed: bool) -> str | None:
    """None for a whole answer; ``cut`` when the body broke off after its head."""
    try:
        text = "".join([chunk async for chunk in response.aiter_text()])
    except httpx.RemoteProtocolError:
        return "cut"
    if streamed and "data: [DONE]" not in text:
        return "stream without [DONE]"
    return None


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def _phase(outcomes: list[Outcome], since: float, until: float) -> list[Outcome]:
    return [o for o in outcomes if since <= o.started < until]


Kind = tuple[str | None, bool]
"""The answering replica, and whether the answer was streamed."""


def _normal_latency(warm: list[Outcome]) -> dict[Kind, float]:
    """The median warm-up latency of each kind of answer."""
    kinds: dict[Kind, list[float]] = {}
    for outcome in warm:
        kinds.setdefault((outcome.replica, outcome.streamed), []).append(outcome.latency_s)
    return {kind: statistics.median(latencies) for kind, latencies in kinds.items()}


def _summary(name: str, outcomes: list[Outcome]) -> str:
    errors = [o for o in outcomes if o.error is not None]
    slowest = max(outcomes, key=lambda o: o.latency_s)
    by_replica: dict[str | None, int] = {}
    for outcome in outcomes:
        by_replica[outcome.replica] = by_replica.get(outcome.replica, 0) + 1
    return (
        f"{name}: {len(outcomes)} requests, {len(errors)} errors"
        f" {[(o.number, o.replica, o.error) for o in errors]},"
        f" max latency {slowest.latency_s:.3f}s (#{slowest.number},"
        f" streamed={slowest.streamed}, from {slowest.replica}), by replica {by_replica}"
    )


def _drive(sims: Sims, proxy: Proxy) -> tuple[list[Outcome], dict[str, float]]:
    """The traffic and the faults on its clock; the outcomes and when each phase began."""
    outcomes: list[Outcome] = []
    marks: dict[str, float] = {}

    async def main() -> None:
        until = asyncio.Event()
        load = asyncio.ensure_future(Load(proxy.base_url, outcomes).run(until))
        marks["warm"] = time.monotonic()
        await asyncio.sleep(3.0)
        marks["stop"] = time.monotonic()
        sims.children[STOPPED].signal(signal.SIGSTOP)
        await asyncio.sleep(10.0)
        sims.children[STOPPED].signal(signal.SIGCONT)
        await asyncio.sleep(4.0)  # back in routing once its checks pass again
        marks["kill"] = time.monotonic()
        sims.children[KILLED].signal(signal.SIGKILL)
        await asyncio.sleep(3.0)
        marks["end"] = time.monotonic()
        until.set()
        await load

    asyncio.run(main())
    return outcomes, marks


def test_a_stopped_replica_costs_no_error_and_a_killed_one_cuts_only_its_streams(
    stack: ExitStack, tmp_path: Path
) -> None:
    sims: dict[str, list[str]] = {f"r{i}": [] for i in range(1, 5)}
    sims[KILLED] = ["--stream-stall-s", str(STREAM_STALL_S)]
    fleet, proxy = _start(stack, tmp_path, sims)
    outcomes, marks = _drive(fleet, proxy)
    warm = _phase(outcomes, marks["warm"], marks["stop"])
    stopped = _phase(outcomes, marks["stop"], marks["kill"])
    killed = _phase(outcomes, marks["kill"], marks["end"])
    normal, bound = _normal_latency(warm), hang_bound_s()
    log = (tmp_path / "proxy.log").read_text(errors="replace")
    print(f"\nhang bound {bound:.2f}s; median latencies {normal}")
    for name, phase in (("warm-up", warm), ("SIGSTOP 10s", stopped), ("SIGKILL", killed)):
        print(_summary(name, phase))
    cut = [o for o in outcomes if o.error == "cut"]
    print(f"streams cut by the kill: {[(o.number, o.replica) for o in cut]}")
    usual = max(normal.values())  # a kind of answer the warm-up did not see
    late = [
        o
        for o in stopped
        if o.latency_s > bound + normal.get((o.replica, o.streamed), usual) + SLACK_S
    ]
    print(f"slower than the bound + their median + {SLACK_S}s: {len(late)}")
    print("proxy log:", *[line for line in log.splitlines() if " WARNING " in line], sep="\n")

    assert [o for o in outcomes if o.error not in (None, "cut")] == []
    kill = marks["kill"]
    assert all(o.streamed and o.replica == KILLED for o in cut)
    assert all(o.started < kill <= o.started + o.latency_s for o in cut), "not in flight"
    assert late == [], f"slower than the bound: {[(o.number, o.latency_s) for o in late]}"
    assert f"replica {STOPPED} ejected" in log and "retry on replica" in log
    assert "ASGI" not in log and "Traceback" not in log


def test_a_stream_cut_by_its_dying_replica_ends_without_its_end_and_nothing_escapes(
    stack: ExitStack, tmp_path: Path
) -> None:
    stalled = ["--stream-stall-s", "30"]
    fleet, proxy = _start(stack, tmp_path, {"r1": stalled, "r2": stalled})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with (
        httpx.Client(base_url=proxy.base_url, timeout=20, trust_env=False) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        chunks = response.iter_raw()
        assert next(chunks).startswith(b"data: ")
        replica = response.headers["x-kvindex-replica"]
        fleet.children[replica].kill()
        killed = time.monotonic()
        with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
            for _ in chunks:
                pass
        print(f"\nstream from {replica} cut {time.monotonic() - killed:.3f}s after the kill")
    log = (tmp_path / "proxy.log").read_text(errors="replace")
    print("proxy log:", *[line for line in log.splitlines() if "kvindex" in line][-4:], sep="\n")
    assert "ASGI" not in log and "Traceback" not in log
    assert f"answer from {replica} cut" in log
    cut = f'kvindex_proxy_upstream_errors_total{{kind="cut",replica="{replica}"}} 1.0'
    assert cut in proxy.metrics()
