"""``kvindex demo``: the same seeded workload routed round-robin and by ``POST /score``, replica
sims, indexer and API in this process (loopback), a fresh fleet per policy, replayed in rounds;
TTFT comes from vLLM's step model (:func:`first_token_times`), not from a clock."""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import statistics
import textwrap
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
    ReplicaSim,
    ReplicaSimSettings,
)
from kvindex.clients.fake_vllm.scheduler import STEP_BASE_S, STEP_PER_TOKEN_S
from kvindex.clients.fake_vllm.tokenizer import (
    VOCAB_SIZE,
    tokenize_text,
)
from kvindex.clients.http import AsyncKvIndexClient
from kvindex.clients.workloads.generators import UserSession, user_sessions
from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.service import IndexerService

POLICIES = ("round_robin", "kv_aware")


class DemoError(KvIndexError):
    """Invalid demo settings, or a fleet that did not come up."""


@dataclass(frozen=True, slots=True)
class DemoSettings:
    replicas: int = 4
    requests: int = 320
    """Requests replayed per policy (the last session is cut to fit)."""
    seed: int = 0
    """Seed of the workload, of the sims' block-hash root and of the API's tie-breaks."""
    speed: float = 20.0
    """Time compression of the sims: real sleep = simulated time / speed."""
    concurrency: int = 16
    """Sessions in flight at once (one turn each per round)."""
    model: str = "demo-model"
    block_size: int = 16
    capacity_blocks: int = 320
    """KV blocks per replica (few: the cache is the scarce resource)."""
    max_running: int = 8
    """Requests a replica runs at once (vLLM's ``max_num_seqs``; the replica-sim's default)."""
    max_batched_tokens: int = 2_048
    """Tokens a replica computes per step (vLLM's ``max_num_batched_tokens``)."""
    max_tokens: int = 24

    def __post_init__(self) -> None:
        names = ("replicas", "requests", "concurrency", "capacity_blocks", "max_running")
        for name in (*names, "max_batched_tokens", "max_tokens"):
            if getattr(self, name) < 1:
                raise DemoError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.speed > 0:
            raise DemoError(f"speed must be > 0, got {self.speed!r}")


def build_workload(settings: DemoSettings) -> list[UserSession]:
    return user_sessions(settings.requests, settings.seed, vocab=VOCAB_SIZE)


# --- results ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    replica: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    """In simulated seconds."""
    waited: bool
    """Admitted after its round's first step."""


@dataclass(frozen=True, slots=True)
class PolicyReport:
    policy: str
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    prefill_tokens: int
    """Prompt tokens the replicas computed (prompt - cached)."""
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    num_waited: int
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
            ttft_p50_s=_quantile(ttfts, 0.5),
            ttft_p90_s=_quantile(ttfts, 0.9),
            num_waited=sum(o.waited for o in outcomes),
            requests_per_replica=dict(sorted(per_replica.items())),
            wall_s=wall_s,
        )

    def figures(self) -> dict[str, Any]:
        """Everything but the wall time."""
        return {k: v for k, v in asdict(self).items() if k != "wall_s"}


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


def _quantile(ordered: Sequence[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def report_table(report: DemoReport) -> Table:
    s = report.settings
    numbers = ("hit rate", "prefilled", "TTFT p50", "TTFT mean")
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
            f"{p.ttft_p50_s * 1000:.0f} ms",
            f"{p.ttft_mean_s * 1000:.0f} ms",
            " ".join(f"{r}:{n}" for r, n in p.requests_per_replica.items()),
        )
    return table


def report_notes(report: DemoReport) -> str:
    s = report.settings
    waited = ", ".join(f"{p.policy} {p.num_waited}" for p in report.policies)
    return textwrap.fill(
        "prefilled: prompt tokens the replicas computed (not found in their cache). TTFT:"
        " simulated time from a round's start to a request's first token, on vLLM's step"
        f" model with at most {s.max_running} requests running and {s.max_batched_tokens:,}"
        f" tokens a step per replica. Requests that waited to be admitted: {waited}.",
        width=80,
    )


# --- the fleet ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fleet:
    api_url: str
    replica_urls: dict[str, str]
    sync: Callable[[], None]
    """Returns once the index holds every event the sims published before the call."""


@contextmanager
def running_fleet(settings: DemoSettings) -> Iterator[Fleet]:
    """Fresh sims, an indexer synced with them and the API on loopback; stopped on exit."""
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
            _wait(functools.partial(_connected, service, sim), f"{sim.settings.id} to connect")
        sync = functools.partial(_sync, service, sims)
        sync()
        api_url = stack.enter_context(_api_server(settings, service))
        yield Fleet(api_url, {sim.settings.id: sim.base_url for sim in sims}, sync)


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
        prefill_tps=1 / STEP_PER_TOKEN_S,
        decode_tps=1 / STEP_BASE_S,
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
        time.sleep(0.001)


def _connected(service: IndexerService, sim: ReplicaSim) -> bool:
    status = service.registry.status(StreamId(sim.settings.id, 0))
    return status is not None and status.health.connected


def _sync(service: IndexerService, sims: Sequence[ReplicaSim]) -> None:
    """Wait until the indexer applied an empty batch from every sim, so every batch before
    it too (streams are ordered; one lost to ZeroMQ's slow joiner comes by replay)."""
    fences = {}
    for sim in sims:
        assert sim.publisher is not None, "sim not started"
        fences[StreamId(sim.settings.id, 0)] = sim.publisher.publish([])

    def applied() -> bool:
        for stream, seq in fences.items():
            status = service.registry.status(stream)
            if status is None or not status.health.connected or status.health.last_seq < seq:
                return False
        return True

    _wait(applied, "the indexer to apply the sims' events")


@contextmanager
def _api_server(settings: DemoSettings, service: IndexerService) -> Iterator[str]:
    """The API over the service's index, in a thread; no load scraper (the replay reports it)."""
    api = ApiSettings(port=0, scrape_interval_s=0.0, seed=settings.seed)
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


@dataclass(slots=True)
class _Session:
    session: UserSession
    history: list[int]
    turn: int = 0

    def prompt(self) -> list[int]:
        turn = self.session.turns[self.turn]
        return self.history + turn if self.session.chat else self.session.system + turn


@dataclass(frozen=True, slots=True)
class _Run:
    settings: DemoSettings
    fleet: Fleet
    policy: str
    http: httpx.AsyncClient
    router: AsyncKvIndexClient
    on_done: Callable[[], None]


async def replay(
    settings: DemoSettings,
    fleet: Fleet,
    policy: str,
    sessions: Sequence[UserSession],
    on_done: Callable[[], None],
) -> list[Outcome]:
    """Every session, ``concurrency`` at a time, in rounds, routed by ``policy``; the
    outcomes in a fixed order."""
    outcomes: list[Outcome] = []
    pending = collections.deque(sessions)
    active: list[_Session] = []
    limits = httpx.Limits(max_connections=4 * settings.concurrency)
    async with (
        httpx.AsyncClient(timeout=60, limits=limits, trust_env=False) as http,
        AsyncKvIndexClient(fleet.api_url, timeout_s=30, http=http) as router,
    ):
        run = _Run(settings, fleet, policy, http, router, on_done)
        while pending or active:
            while pending and len(active) < settings.concurrency:
                session = pending.popleft()
                active.append(_Session(session, list(session.system)))
            outcomes += await _run_round(run, active)
            active = [s for s in active if s.turn < len(s.session.turns)]
    return outcomes


async def _run_round(run: _Run, active: Sequence[_Session]) -> list[Outcome]:
    """Route each session's next turn in order, then let each replica serve its share.
    Load is reported idle first (the last round has ended), and the API counts the answers
    routed since, so a decision sees the ones before it."""
    run.fleet.sync()
    for replica in run.fleet.replica_urls:
        await run.router.report_load(replica, running=0, waiting=0)
    shares: dict[str, list[_Session]] = {r: [] for r in run.fleet.replica_urls}
    for session in active:
        answer = await run.router.score_tokens(
            run.settings.model,
            session.prompt(),
            block_size=run.settings.block_size,
            policy=run.policy,
        )
        shares[answer.best or next(iter(shares))].append(session)
    served = await asyncio.gather(*(_serve(run, r, s) for r, s in shares.items() if s))
    return [outcome for share in served for outcome in share]


async def _serve(run: _Run, replica: str, share: Sequence[_Session]) -> list[Outcome]:
    """The replica's requests of one round, sent one after another in the order routed (so
    its cache sees them in that order); their times from :func:`first_token_times`."""
    settings = run.settings
    url = run.fleet.replica_urls[replica] + "/v1/completions"
    served: list[tuple[int, int]] = []  # (prompt tokens, cached tokens)
    for session in share:
        prompt = session.prompt()
        body = {"model": settings.model, "prompt": prompt, "max_tokens": settings.max_tokens}
        response = await run.http.post(url, json=body)
        if response.status_code != 200:
            raise DemoError(f"{replica} answered {response.status_code}: {response.text}")
        result = response.json()
        served.append((len(prompt), result["kvsim"]["cached_tokens"]))
        session.history = prompt + tokenize_text(result["choices"][0]["text"])
        session.turn += 1
        run.on_done()
    timings = first_token_times(
        [prompt - cached for prompt, cached in served],
        settings.max_tokens,
        settings.max_running,
        settings.max_batched_tokens,
    )
    return [
        Outcome(replica, prompt, cached, ttft_s, waited)
        for (prompt, cached), (ttft_s, waited) in zip(served, timings, strict=True)
    ]


@dataclass(slots=True)
class _Job:
    index: int
    prefill_left: int
    outputs_left: int
    ttft_s: float = 0.0
    waited: bool = False
    first_token: bool = False
    """The last step completed its prefill."""

    def advance(self, budget: int) -> int:
        """A prefill chunk or one decode token within ``budget``; the tokens used."""
        self.first_token = False
        if budget <= 0:
            return 0
        if self.prefill_left == 0:
            self.outputs_left -= 1
            return 1
        count = min(self.prefill_left, budget)
        self.prefill_left -= count
        if self.prefill_left == 0:
            self.first_token = True
            self.outputs_left -= 1
        return count


def first_token_times(
    uncached_tokens: Sequence[int], max_tokens: int, max_running: int, max_batched_tokens: int
) -> list[tuple[float, bool]]:
    """(seconds to first token, waited) of requests reaching an idle replica together, on
    vLLM's step as :class:`~kvindex.clients.fake_vllm.scheduler.StepScheduler` models it:
    running requests first, then admissions in order while budget and slots allow."""
    waiting = collections.deque(
        _Job(i, max(1, n), max_tokens) for i, n in enumerate(uncached_tokens)
    )
    jobs = list(waiting)
    running: list[_Job] = []
    now = 0.0
    while waiting or running:
        budget = max_batched_tokens
        for job in running:
            budget -= job.advance(budget)
        while waiting and budget > 0 and len(running) < max_running:
            running.append(job := waiting.popleft())
            job.waited = now > 0
            budget -= job.advance(budget)
        now += STEP_BASE_S + STEP_PER_TOKEN_S * (max_batched_tokens - budget)
        for job in running:
            if job.first_token:
                job.ttft_s = now
        running = [job for job in running if job.outputs_left > 0]
    return [(job.ttft_s, job.waited) for job in jobs]


# --- the whole demo -----------------------------------------------------------------------


def run_demo(settings: DemoSettings, console: Console | None = None) -> DemoReport:
    """Replay the workload per policy, each on a fresh fleet; a progress bar on ``console``."""
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
    """The command: progress on stderr, the table on ``console``, then ``json_path``."""
    report = run_demo(settings, progress_console())
    console.print(report_table(report))
    console.print(report_notes(report))
    console.print(
        f"wall time {report.wall_s:.1f} s; every other figure is the same on every run"
        f" with seed {settings.seed}"
    )
    if json_path is not None:
        json_path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return report
