"""``kvindex demo``: the same seeded workload routed round-robin and by ``POST /score``.

Everything runs in this process on loopback with nothing else installed: N
:class:`~kvindex.clients.fake_vllm.replica.ReplicaSim` (real block caches, vLLM KV events,
HTTP), the
indexer (:class:`~kvindex.indexer.service.IndexerService` over a :class:`MemoryIndex`, the sims as
connect-mode replicas with replay and URLs) and the API (uvicorn in a background thread,
scraping the sims' ``/metrics``). Each policy starts from a fresh fleet (cold caches).

The workload (:func:`~kvindex.clients.workloads.user_sessions`) is a function of the seed: a
few shared system prompts used by many users, multi-turn chats whose prompt is the whole
history (the replica's own output included, so the next turn can hit it), and RAG queries
drawing chunks from a shared, Zipf-popular document pool. Sessions run ``concurrency`` at a
time, turns of one session in order, so queues form and load matters.

Guarantees: :func:`run_demo` stops every server, thread and socket it started before it
returns or raises; only 127.0.0.1 is used.
"""

from __future__ import annotations

import asyncio
import functools
import json
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from kvindex.api.config.settings import ApiSettings
from kvindex.api.http.app import create_app
from kvindex.api.http.background import BackgroundServer, ServerStartError
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.runtime import ApiDeps
from kvindex.clients.console import ProgressBars, column, make_table, progress_console
from kvindex.clients.fake_vllm.replica import (
    VOCAB_SIZE,
    ReplicaSim,
    ReplicaSimSettings,
    tokenize_text,
)
from kvindex.clients.http import AsyncKvIndexClient
from kvindex.clients.workloads import UserSession, user_sessions
from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.service import IndexerService

POLICIES = ("round_robin", "kv_aware")
"""Compared in this order, each on a fresh fleet."""


class DemoError(KvIndexError):
    """Invalid demo settings, or a fleet that did not come up."""


@dataclass(frozen=True, slots=True)
class DemoSettings:
    """The demo's knobs; validated on construction."""

    replicas: int = 4
    """Simulated replicas in the fleet."""
    requests: int = 320
    """Requests replayed per policy (the last session is cut to fit)."""
    seed: int = 0
    """Seed of the workload (and of the sims' block-hash root)."""
    speed: float = 20.0
    """Time compression of the sims: real sleep = simulated time / speed."""
    concurrency: int = 16
    """Sessions in flight at once."""
    model: str = "demo-model"
    """Model name served by every sim."""
    block_size: int = 16
    """Tokens per KV block."""
    capacity_blocks: int = 320
    """KV blocks per replica (small on purpose: the fleet's cache is the scarce resource)."""
    max_running: int = 4
    """Requests a sim runs at once; the rest queue."""
    max_tokens: int = 24
    """Output tokens per request."""
    scrape_interval_s: float = 0.1
    """How often the API scrapes the sims' /metrics for load."""

    def __post_init__(self) -> None:
        for name in ("replicas", "requests", "concurrency", "capacity_blocks", "max_tokens"):
            if getattr(self, name) < 1:
                raise DemoError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("speed", "scrape_interval_s"):
            if not getattr(self, name) > 0:
                raise DemoError(f"{name} must be > 0, got {getattr(self, name)!r}")


# --- the workload -------------------------------------------------------------------------


def build_workload(settings: DemoSettings) -> list[UserSession]:
    """The demo's sessions (:func:`~kvindex.clients.workloads.user_sessions`) in the replica
    simulator's vocabulary, so that its toy tokenizer can write them out as text."""
    return user_sessions(settings.requests, settings.seed, vocab=VOCAB_SIZE)


# --- results ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """One finished request, as the sim reported it (times in simulated seconds)."""

    replica: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


@dataclass(frozen=True, slots=True)
class PolicyReport:
    policy: str
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    """Cached prompt tokens / prompt tokens."""
    prefill_tokens: int
    """Prompt tokens the replicas computed (prompt - cached)."""
    ttft_mean_s: float
    ttft_p90_s: float
    requests_per_replica: dict[str, int]
    wall_s: float

    @classmethod
    def of(cls, policy: str, outcomes: Sequence[Outcome], wall_s: float) -> PolicyReport:
        prompt = sum(o.prompt_tokens for o in outcomes)
        cached = sum(o.cached_tokens for o in outcomes)
        ttfts = sorted(o.ttft_s for o in outcomes)
        per_replica = Counter(o.replica for o in outcomes)
        return cls(
            policy=policy,
            num_requests=len(outcomes),
            prompt_tokens=prompt,
            cached_tokens=cached,
            hit_rate=cached / prompt if prompt else 0.0,
            prefill_tokens=prompt - cached,
            ttft_mean_s=statistics.fmean(ttfts) if ttfts else 0.0,
            ttft_p90_s=ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else 0.0,
            requests_per_replica=dict(sorted(per_replica.items())),
            wall_s=wall_s,
        )


@dataclass(frozen=True, slots=True)
class DemoReport:
    settings: DemoSettings
    policies: list[PolicyReport] = field(default_factory=list)
    wall_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": asdict(self.settings),
            "policies": {p.policy: asdict(p) for p in self.policies},
            "wall_s": self.wall_s,
        }


def report_table(report: DemoReport) -> Table:
    s = report.settings
    numbers = ("hit rate", "prefill tokens", "TTFT mean", "TTFT p90")
    table = make_table(
        column("policy"),
        *(column(name, justify="right") for name in numbers),
        column("requests per replica"),
        title=f"kvindex demo: {s.replicas} replicas, {s.requests} requests, seed {s.seed}",
    )
    for p in report.policies:
        table.add_row(
            p.policy,
            f"{p.hit_rate:.1%}",
            f"{p.prefill_tokens:,}",
            f"{p.ttft_mean_s * 1000:.0f} ms",
            f"{p.ttft_p90_s * 1000:.0f} ms",
            " ".join(f"{r}:{n}" for r, n in p.requests_per_replica.items()),
        )
    return table


# --- the fleet ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fleet:
    api_url: str
    replica_urls: dict[str, str]


@contextmanager
def running_fleet(settings: DemoSettings) -> Iterator[Fleet]:
    """Fresh sims, an indexer subscribed to all of them (synced and live), and the API on a
    free loopback port; everything stopped on exit, in reverse order."""
    with ExitStack() as stack:
        sims = [stack.enter_context(_sim(settings, f"r{i + 1}")) for i in range(settings.replicas)]
        specs = tuple(
            ReplicaSpec(
                id=sim.settings.id,
                model=settings.model,
                events=sim.events_endpoint,
                replay=sim.replay_endpoint,
                url=sim.base_url,
            )
            for sim in sims
        )
        indexer_settings = IndexerSettings(
            replicas=specs, log_level="WARNING", replay_timeout_s=2.0, reconnect_max_s=0.2
        )
        service = IndexerService.build(indexer_settings, MemoryIndex())
        service.start()
        stack.callback(service.stop)
        for sim in sims:
            _wait_live(service, sim)
        api_url = stack.enter_context(_api_server(settings, service))
        yield Fleet(api_url, {sim.settings.id: sim.base_url for sim in sims})


@contextmanager
def _sim(settings: DemoSettings, replica: str) -> Iterator[ReplicaSim]:
    sim_settings = ReplicaSimSettings(
        id=replica,
        model=settings.model,
        block_size=settings.block_size,
        capacity_blocks=settings.capacity_blocks,
        events="tcp://127.0.0.1:*",
        replay="tcp://127.0.0.1:*",
        port=0,
        max_running=settings.max_running,
        speed=settings.speed,
        seed=settings.seed,
    )
    with ReplicaSim(sim_settings) as sim:
        yield sim


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise DemoError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _wait_live(service: IndexerService, sim: ReplicaSim) -> None:
    """Wait until the indexer receives ``sim``'s events live (ZeroMQ's slow joiner: a
    batch published before the subscription is up would only arrive by replay)."""
    stream = StreamId(sim.settings.id, 0)

    def applied(seq: int) -> Callable[[], bool]:
        def check() -> bool:
            status = service.registry.status(stream)
            return status is not None and status.health.connected and status.health.last_seq >= seq

        return check

    assert sim.publisher is not None, "sim not started"
    _wait(
        lambda: (s := service.registry.status(stream)) is not None and s.health.connected, "connect"
    )
    _wait(applied(sim.publisher.publish([])), f"{stream} first batch")


@contextmanager
def _api_server(settings: DemoSettings, service: IndexerService) -> Iterator[str]:
    """The API over the service's index and registry, uvicorn in a thread on a free port."""
    api = ApiSettings(port=0, scrape_interval_s=settings.scrape_interval_s, seed=settings.seed)
    loads = MemoryLoadStore()
    deps = ApiDeps(api, service.index, service.registry, loads, blocking_store=False)
    server = BackgroundServer(create_app(deps), name="kvindex-demo-api")
    try:
        server.start()
    except ServerStartError as exc:
        loads.close()
        raise DemoError(str(exc)) from exc
    try:
        yield server.base_url
    finally:
        server.stop()
        loads.close()


# --- replaying the workload ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Run:
    """What every request of one policy's replay needs."""

    settings: DemoSettings
    fleet: Fleet
    policy: str
    http: httpx.AsyncClient
    router: AsyncKvIndexClient
    record: Callable[[Outcome], None]


async def replay(
    settings: DemoSettings,
    fleet: Fleet,
    policy: str,
    sessions: Sequence[UserSession],
    on_done: Callable[[], None],
) -> list[Outcome]:
    """Run every session (``concurrency`` at a time), routing each request by ``policy``
    through ``POST /score``; the outcomes in completion order."""
    outcomes: list[Outcome] = []
    pending = list(reversed(sessions))

    def record(outcome: Outcome) -> None:
        outcomes.append(outcome)
        on_done()

    limits = httpx.Limits(max_connections=4 * settings.concurrency)
    async with (
        httpx.AsyncClient(timeout=60, limits=limits, trust_env=False) as http,
        AsyncKvIndexClient(fleet.api_url, timeout_s=30, http=http) as router,
    ):
        run = _Run(settings, fleet, policy, http, router, record)

        async def worker() -> None:
            while pending:
                await _run_session(run, pending.pop())

        await asyncio.gather(*(worker() for _ in range(settings.concurrency)))
    return outcomes


async def _run_session(run: _Run, session: UserSession) -> None:
    """The session's turns in order; a chat's next prompt carries the replica's answer."""
    model, fleet = run.settings.model, run.fleet
    history = list(session.system)
    for turn in session.turns:
        prompt = history + turn if session.chat else session.system + turn
        answer = await run.router.score_tokens(
            model, prompt, block_size=run.settings.block_size, policy=run.policy
        )
        replica = answer.best or next(iter(fleet.replica_urls))
        body = {"model": model, "prompt": prompt, "max_tokens": run.settings.max_tokens}
        response = await run.http.post(fleet.replica_urls[replica] + "/v1/completions", json=body)
        if response.status_code != 200:
            raise DemoError(f"{replica} answered {response.status_code}: {response.text}")
        result = response.json()
        kvsim = result["kvsim"]
        run.record(Outcome(replica, len(prompt), kvsim["cached_tokens"], kvsim["ttft_s"]))
        history = prompt + tokenize_text(result["choices"][0]["text"])


# --- the whole demo -----------------------------------------------------------------------


def run_demo(settings: DemoSettings, console: Console | None = None) -> DemoReport:
    """Replay the workload once per policy, each on a fresh fleet; a progress bar on
    ``console`` (None: quiet). Everything started is stopped before returning."""
    started = time.monotonic()
    sessions = build_workload(settings)
    reports: list[PolicyReport] = []
    with ProgressBars(console, label_width=12) as bars:
        for policy in POLICIES:
            advance = functools.partial(bars.add(policy, total=settings.requests), 1)
            with running_fleet(settings) as fleet:
                t0 = time.monotonic()
                outcomes = asyncio.run(replay(settings, fleet, policy, sessions, advance))
                reports.append(PolicyReport.of(policy, outcomes, time.monotonic() - t0))
    return DemoReport(settings, reports, time.monotonic() - started)


def demo_main(settings: DemoSettings, json_path: Path | None, console: Console) -> DemoReport:
    """The ``kvindex demo`` command: run (progress on stderr), print the table on
    ``console``, write ``json_path`` if given."""
    report = run_demo(settings, progress_console())
    console.print(report_table(report))
    console.print(f"wall time {report.wall_s:.1f} s")
    if json_path is not None:
        json_path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return report
