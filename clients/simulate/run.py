"""``kvindex simulate``: the same requests through a simulated fleet under each policy.

For each policy (in the order given) a fresh fleet (:mod:`kvindex.clients.simulate.fleet`)
replays the
requests (:mod:`kvindex.clients.workloads`) with that policy's router
(:mod:`kvindex.clients.simulate.routing`);
then the references: the **oracle** (``kv_aware`` with perfect, instant knowledge; listed
as a policy) and the **single-cache ceiling** (the hit rate of one LRU cache with the whole
fleet's capacity that sees every request in arrival order, nothing pinned).

Per policy (:class:`PolicyStats`): prefix-cache hit rate (token-weighted: cached prompt
tokens / prompt tokens), prompt tokens computed, TTFT mean / p50 / p90 / p99 (nearest-rank),
queue depth mean and max (waiting requests per replica, sampled at each arrival), requests
per replica max / mean (``imbalance``), rejected requests (longer than one replica's pool),
and the hit rate over time. Output: a table, ``--json`` and ``--plot``.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvindex.clients.console import ProgressBars, column, make_table, progress_console
from kvindex.clients.fake_vllm.block_pool import BlockPool
from kvindex.clients.simulate.fleet import (
    FleetResult,
    FleetSettings,
    FleetSim,
    Outcome,
    Prompts,
    SimulationError,
)
from kvindex.clients.simulate.routing import (
    INDEX_POLICIES,
    ORACLE,
    IngestSink,
    OracleRouter,
    PolicySpec,
    ScorerRouter,
    SimClock,
    ZmqSink,
    parse_policy,
)
from kvindex.clients.workloads import TraceRequest

DEFAULT_POLICIES = (
    "round_robin",
    "random",
    "least_load",
    "session_affinity",
    "prefix_hash",
    "kv_aware",
    ORACLE,
)
TIMELINE_POINTS = 40
"""Windows of the hit-rate-over-time series."""


@dataclass(frozen=True, slots=True)
class SimulateSettings:
    fleet: FleetSettings = field(default_factory=FleetSettings)
    policies: tuple[PolicySpec, ...] = tuple(parse_policy(p) for p in DEFAULT_POLICIES)
    event_delay_s: float = 0.05
    """Lag between a replica emitting a KV event and the index applying it."""
    load_interval_s: float = 0.0
    """How often the router learns the replicas' load (0: at every request; the API's
    scraper default is 2 s). The oracle always knows it."""
    stale_after_s: float = 300.0
    """A replica silent this long is stale (its cache credit is reduced), as in the indexer."""
    speed: float = 1.0
    """Arrival-time compression: 2 replays the trace twice as fast."""
    seed: int = 0
    via_zmq: bool = False
    """Send events over real ZeroMQ (loopback) to an in-process indexer."""

    def __post_init__(self) -> None:
        if not self.speed > 0 or not math.isfinite(self.speed):
            raise SimulationError(f"speed must be a positive number, got {self.speed}")
        if not 0 <= self.event_delay_s < math.inf:
            raise SimulationError(f"event delay must be >= 0 seconds, got {self.event_delay_s}")
        if not 0 <= self.load_interval_s < math.inf:
            raise SimulationError(f"load interval must be >= 0 seconds, got {self.load_interval_s}")
        if not self.policies:
            raise SimulationError("no policies to compare")


@dataclass(frozen=True, slots=True)
class PolicyStats:
    policy: str
    hit_rate: float
    prefill_tokens: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    queue_mean: float
    queue_max: int
    imbalance: float
    """Requests per replica, max / mean (1.0: perfectly even)."""
    requests: int
    rejected: int
    wall_s: float
    hit_rate_timeline: list[tuple[float, float]]
    """(window start, hit rate of the requests arriving in it)."""


@dataclass(frozen=True, slots=True)
class SimReport:
    policies: list[PolicyStats]
    ceiling_hit_rate: float
    params: dict[str, Any]
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "policies": [asdict(p) for p in self.policies],
            "ceiling_hit_rate": self.ceiling_hit_rate,
            "params": self.params,
            "wall_s": self.wall_s,
        }

    def stats(self, label: str) -> PolicyStats:
        return next(p for p in self.policies if p.policy == label)


# --- statistics ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def policy_stats(label: str, result: FleetResult, wall_s: float) -> PolicyStats:
    served = [o for o in result.outcomes if not o.rejected]
    prompt = sum(o.input_tokens for o in served)
    hit = sum(o.hit_tokens for o in served)
    ttfts = [o.ttft_s for o in served]
    counts = list(result.requests_per_replica.values())
    mean_count = statistics.fmean(counts) if counts else 0.0
    return PolicyStats(
        policy=label,
        hit_rate=hit / prompt if prompt else 0.0,
        prefill_tokens=prompt - hit,
        ttft_mean_s=statistics.fmean(ttfts) if ttfts else 0.0,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        queue_mean=statistics.fmean(result.queue_samples) if result.queue_samples else 0.0,
        queue_max=max(result.queue_samples, default=0),
        imbalance=max(counts) / mean_count if mean_count else 0.0,
        requests=len(result.outcomes),
        rejected=len(result.outcomes) - len(served),
        wall_s=wall_s,
        hit_rate_timeline=timeline(served),
    )


def timeline(
    outcomes: Sequence[Outcome], points: int = TIMELINE_POINTS
) -> list[tuple[float, float]]:
    if not outcomes:
        return []
    end = max(o.arrival_s for o in outcomes)
    width = end / points if end > 0 else 1.0
    hit = [0] * points
    total = [0] * points
    for o in outcomes:
        i = min(points - 1, int(o.arrival_s / width))
        hit[i] += o.hit_tokens
        total[i] += o.input_tokens
    return [(i * width, hit[i] / total[i]) for i in range(points) if total[i]]


def ceiling_hit_rate(
    requests: Sequence[TraceRequest], fleet: FleetSettings, prompts: Prompts | None = None
) -> float:
    """Hit rate of one LRU pool of ``replicas * capacity_blocks`` blocks, requests in
    arrival order, each released at once (nothing pinned)."""
    prompts = prompts if prompts is not None else Prompts(requests, fleet)
    capacity = fleet.replicas * fleet.capacity_blocks
    cache = BlockPool(capacity, fleet.block_size, prompts.root, publish=False)
    hit = total = 0
    for i in range(len(requests)):
        tokens, chain = prompts.get(i)
        admission = cache.admit(i, tokens, len(tokens), chain=chain)
        if admission is None:  # longer than the whole fleet: counted as a miss
            total += len(tokens)
            continue
        hit += admission.num_hit_blocks * fleet.block_size
        total += len(tokens)
        cache.release(i)
    return hit / total if total else 0.0


# --- running ---------------------------------------------------------------------------------


def scaled(requests: Sequence[TraceRequest], speed: float) -> list[TraceRequest]:
    if speed == 1.0:
        return list(requests)
    return [replace(r, arrival_s=r.arrival_s / speed) for r in requests]


async def run_policy(
    settings: SimulateSettings,
    spec: PolicySpec,
    requests: Sequence[TraceRequest],
    progress: Callable[[int], None] | None = None,
    prompts: Prompts | None = None,
) -> PolicyStats:
    """One policy over a fresh fleet."""
    started = time.perf_counter()
    clock = SimClock()
    fleet = settings.fleet
    if spec.policy == ORACLE:
        oracle = OracleRouter(spec, seed=settings.seed)
        sim = FleetSim(fleet, oracle, requests, prompts=prompts, publish=False, progress=progress)
        oracle.watch(sim.cache)
        result = await sim.run()
    else:
        sink = _sink(settings, spec, clock)
        router = ScorerRouter(
            spec,
            fleet,
            sink=sink,
            clock=clock,
            seed=settings.seed,
            load_interval_s=settings.load_interval_s,
        )
        try:
            sim = FleetSim(
                fleet,
                router,
                requests,
                prompts=prompts,
                publish=sink is not None,
                progress=progress,
            )
            result = await sim.run()
        finally:
            router.close()
    return policy_stats(spec.label, result, time.perf_counter() - started)


def _sink(
    settings: SimulateSettings, spec: PolicySpec, clock: SimClock
) -> IngestSink | ZmqSink | None:
    if spec.policy not in INDEX_POLICIES:
        return None
    if settings.via_zmq:
        return ZmqSink(
            settings.fleet,
            event_delay_s=settings.event_delay_s,
            stale_after_s=settings.stale_after_s,
        )
    return IngestSink(
        settings.fleet,
        clock,
        event_delay_s=settings.event_delay_s,
        stale_after_s=settings.stale_after_s,
    )


def run_simulation(
    settings: SimulateSettings,
    requests: Sequence[TraceRequest],
    *,
    progress_for: Callable[[str], Callable[[int], None]] | None = None,
    source: str = "",
) -> SimReport:
    """Every policy, then the ceiling. ``progress_for(label)`` gives the callback a policy's
    run calls once per finished request."""
    started = time.perf_counter()
    requests = scaled(requests, settings.speed)
    prompts = Prompts(requests, settings.fleet)
    stats = []
    for spec in settings.policies:
        progress = progress_for(spec.label) if progress_for is not None else None
        stats.append(asyncio.run(run_policy(settings, spec, requests, progress, prompts)))
    ceiling = ceiling_hit_rate(requests, settings.fleet, prompts)
    params = _params(settings, requests, source)
    return SimReport(stats, ceiling, params, time.perf_counter() - started)


def simulate_main(
    settings: SimulateSettings,
    requests: Sequence[TraceRequest],
    *,
    source: str,
    console: Console,
    json_path: Path | None = None,
    plot_path: Path | None = None,
) -> SimReport:
    """The command: progress bars (on stderr), the table, then ``--json`` and ``--plot``."""
    with ProgressBars(progress_console(), label_width=20) as bars:
        report = run_simulation(
            settings,
            requests,
            progress_for=lambda label: bars.add(label, total=len(requests)),
            source=source,
        )
    console.print(report_table(report))
    try:
        if json_path is not None:
            json_path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
            console.print(f"wrote {json_path}")
        if plot_path is not None:
            plot(report, plot_path)
            console.print(f"wrote {plot_path}")
    except OSError as exc:
        raise SimulationError(f"cannot write the results: {exc}") from exc
    return report


def _params(
    settings: SimulateSettings, requests: Sequence[TraceRequest], source: str
) -> dict[str, Any]:
    fleet = asdict(settings.fleet)
    return {
        "source": source,
        "requests": len(requests),
        **fleet,
        "event_delay_s": settings.event_delay_s,
        "load_interval_s": settings.load_interval_s,
        "stale_after_s": settings.stale_after_s,
        "speed": settings.speed,
        "seed": settings.seed,
        "via_zmq": settings.via_zmq,
        "policies": [p.label for p in settings.policies],
    }


# --- output ----------------------------------------------------------------------------------


def report_table(report: SimReport) -> Table:
    """TTFT in seconds; queue = waiting requests per replica; balance = requests per replica
    max / mean."""
    numbers = ("hit rate", "prefill tok", "TTFT mean", "p50", "p90", "p99", "queue", "max")
    table = make_table(
        column("policy"),
        *(column(name, justify="right") for name in numbers),
        column("balance", justify="right"),
        column("rejected", justify="right"),
        title=f"kvindex simulate: {report.params.get('source', '')}",
    )
    for p in report.policies:
        table.add_row(
            p.policy,
            f"{p.hit_rate:.1%}",
            f"{p.prefill_tokens:,}",
            *(f"{v:.3f}" for v in (p.ttft_mean_s, p.ttft_p50_s, p.ttft_p90_s, p.ttft_p99_s)),
            f"{p.queue_mean:.2f}",
            str(p.queue_max),
            f"{p.imbalance:.2f}",
            str(p.rejected),
        )
    table.caption = (
        f"single-cache ceiling hit rate {report.ceiling_hit_rate:.1%}; TTFT in s;"
        f" {report.wall_s:.1f} s wall"
    )
    return table


def plot(report: SimReport, path: Path) -> None:
    """Hit rate and TTFT p90 per policy, and hit rate over time (PNG)."""
    import matplotlib  # noqa: PLC0415 (heavy; only for --plot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    labels = [p.policy for p in report.policies]
    fig, (ax_hit, ax_ttft, ax_time) = plt.subplots(1, 3, figsize=(18, 5))
    ax_hit.barh(labels, [p.hit_rate for p in report.policies])
    ax_hit.axvline(
        report.ceiling_hit_rate, color="black", linestyle="--", label="single-cache ceiling"
    )
    ax_hit.set_xlabel("prefix-cache hit rate (token-weighted)")
    ax_hit.legend(loc="lower right")
    ax_ttft.barh(labels, [p.ttft_p90_s for p in report.policies])
    ax_ttft.set_xlabel("TTFT p90 (s)")
    for p in report.policies:
        if p.hit_rate_timeline:
            xs, ys = zip(*p.hit_rate_timeline, strict=True)
            ax_time.plot(xs, ys, label=p.policy)
    ax_time.set_xlabel("arrival time (s)")
    ax_time.set_ylabel("hit rate")
    ax_time.legend(fontsize="small")
    fig.suptitle(f"kvindex simulate: {report.params.get('source', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
