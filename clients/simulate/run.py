"""``kvindex simulate``: the same requests through a fresh simulated fleet under each policy,
then two references: the oracle (:func:`ceiling_hit_rate`) and one LRU cache."""

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

from rich.console import Console, Group
from rich.text import Text

from kvindex.clients.console import column, make_table
from kvindex.clients.fake_vllm.block_pool import BlockPool
from kvindex.clients.fake_vllm.engine_hash import engine_chain
from kvindex.clients.plotting import pyplot
from kvindex.clients.progress import ProgressLog
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
    INSTANT,
    IngestSink,
    InstantRouter,
    PolicySpec,
    ScorerRouter,
    SimClock,
    ZmqSink,
    parse_policy,
)
from kvindex.clients.workloads.trace import TraceRequest

DEFAULT_POLICIES = (
    "round_robin",
    "random",
    "least_load",
    "session_affinity",
    "prefix_hash",
    "kv_aware",
    INSTANT,
)
TIMELINE_POINTS = 40


@dataclass(frozen=True, slots=True)
class SimulateSettings:
    fleet: FleetSettings = field(default_factory=FleetSettings)
    policies: tuple[PolicySpec, ...] = tuple(parse_policy(p) for p in DEFAULT_POLICIES)
    event_delay_s: float = 0.05
    """Lag between a replica emitting a KV event and the index applying it."""
    load_interval_s: float = 0.0
    """How often the router learns the replicas' load (0: at every request)."""
    stale_after_s: float = 300.0
    """A replica silent this long is stale, as in the indexer."""
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
    throughput_rps: float
    """Requests per second from the first arrival to the last finish (tps: tokens)."""
    throughput_tps: float
    output_tps: float
    kv_usage_mean: float
    """Share of blocks held by running requests, every replica sampled at every arrival."""
    kv_usage_p90: float
    gpu_s_per_request: float
    """Replica-busy seconds per served request: the two below."""
    prefill_gpu_s_per_request: float
    decode_gpu_s_per_request: float
    """Busy seconds with no prefill running (a batch's decode counted once)."""


@dataclass(frozen=True, slots=True)
class SimReport:
    policies: list[PolicyStats]
    ceiling_hit_rate: float
    params: dict[str, Any]
    wall_s: float
    single_cache_hit_rate: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "policies": [asdict(p) for p in self.policies],
            "ceiling_hit_rate": self.ceiling_hit_rate,
            "single_cache_hit_rate": self.single_cache_hit_rate,
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
    usage = result.kv_usage_samples
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
        **throughput(served),
        kv_usage_mean=statistics.fmean(usage) if usage else 0.0,
        kv_usage_p90=percentile(usage, 90),
        **gpu_cost(served),
    )


def throughput(served: Sequence[Outcome]) -> dict[str, float]:
    """Requests, tokens and output tokens per second from the first arrival to the last finish."""
    if not served:
        return {"throughput_rps": 0.0, "throughput_tps": 0.0, "output_tps": 0.0}
    span = max(o.finish_s for o in served) - min(o.arrival_s for o in served)
    per_s = 1.0 / span if span > 0 else 0.0
    output = sum(o.output_tokens for o in served)
    return {
        "throughput_rps": len(served) * per_s,
        "throughput_tps": (sum(o.input_tokens for o in served) + output) * per_s,
        "output_tps": output * per_s,
    }


def gpu_cost(served: Sequence[Outcome]) -> dict[str, float]:
    """Busy seconds per served request (a replica's union of admitted-to-finish spans),
    split into prefill (the sum of prefills, which run serially) and decode (the rest)."""
    if not served:
        keys = ("gpu_s_per_request", "prefill_gpu_s_per_request", "decode_gpu_s_per_request")
        return dict.fromkeys(keys, 0.0)
    spans: dict[str, list[tuple[float, float]]] = {}
    for o in served:
        spans.setdefault(o.replica, []).append((o.admitted_s, o.finish_s))
    busy = sum(_union_length(s) for s in spans.values())
    prefill = sum(o.prefill_s for o in served)
    return {
        "gpu_s_per_request": busy / len(served),
        "prefill_gpu_s_per_request": prefill / len(served),
        "decode_gpu_s_per_request": max(0.0, busy - prefill) / len(served),
    }


def _union_length(spans: list[tuple[float, float]]) -> float:
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


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
    """Hit rate of one unbounded cache fed every prompt and known answer in arrival order.
    Replicas cache only those, admitted in arrival order: no policy can beat it."""
    prompts = prompts if prompts is not None else Prompts(requests, fleet)
    seen: set[int] = set()
    hit = total = 0
    for i, request in enumerate(requests):
        tokens, chain = prompts.get(i)
        total += len(tokens)
        limit = min((len(tokens) - 1) // fleet.block_size, len(chain))
        matched = next((n for n in range(limit) if chain[n] not in seen), limit)
        hit += matched * fleet.block_size
        seen.update(chain)
        if request.output is not None:
            full = tokens + list(request.output)
            seen.update(engine_chain(prompts.root, full, fleet.block_size))
    return hit / total if total else 0.0


def single_cache_hit_rate(
    requests: Sequence[TraceRequest], fleet: FleetSettings, prompts: Prompts | None = None
) -> float:
    """Hit rate of one LRU pool of the fleet's blocks, requests in arrival order, each
    finished at once (nothing pinned) and a known answer cached with its prompt."""
    prompts = prompts if prompts is not None else Prompts(requests, fleet)
    capacity = fleet.replicas * fleet.capacity_blocks
    cache = BlockPool(capacity, fleet.block_size, prompts.root, publish=False)
    hit = total = 0
    for i, request in enumerate(requests):
        tokens, chain = prompts.get(i)
        total += len(tokens)
        answer = request.output
        length = len(tokens) + (len(answer) if answer is not None else 0)
        admission = cache.admit(i, tokens, length, chain=chain)
        if admission is None:  # longer than the whole fleet: counted as a miss
            continue
        hit += admission.num_hit_blocks * fleet.block_size
        if answer is not None:
            full = tokens + list(answer)
            cache.cache_full_blocks(i, full, engine_chain(prompts.root, full, fleet.block_size))
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
    if spec.policy == INSTANT:
        instant = InstantRouter(spec, seed=settings.seed)
        sim = FleetSim(fleet, instant, requests, prompts=prompts, publish=False, progress=progress)
        instant.watch(sim.cache)
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
    progress: ProgressLog | None = None,
    source: str = "",
) -> SimReport:
    """Every policy, then the references; ``progress`` counts each request once per policy."""
    started = time.perf_counter()
    requests = scaled(requests, settings.speed)
    prompts = Prompts(requests, settings.fleet)
    stats = []
    for spec in settings.policies:
        advance = None
        if progress is not None:
            progress.stage, advance = spec.label, progress.advance
        stats.append(asyncio.run(run_policy(settings, spec, requests, advance, prompts)))
    ceiling = ceiling_hit_rate(requests, settings.fleet, prompts)
    single = single_cache_hit_rate(requests, settings.fleet, prompts)
    params = _params(settings, requests, source)
    return SimReport(stats, ceiling, params, time.perf_counter() - started, single)


def simulate_main(
    settings: SimulateSettings,
    requests: Sequence[TraceRequest],
    *,
    source: str,
    console: Console,
    json_path: Path | None = None,
    plot_path: Path | None = None,
    progress_every_s: float = 0.0,
) -> SimReport:
    """The command: progress on stderr, the table, then ``--json`` and ``--plot``."""
    if plot_path is not None:
        pyplot()  # without the extra, say so before the run, not after it
    total = len(requests) * len(settings.policies)
    progress = ProgressLog("simulate", total, every_s=progress_every_s)
    report = run_simulation(settings, requests, progress=progress, source=source)
    progress.finish()
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


def report_table(report: SimReport) -> Group:
    """The figures that fit 80 columns, then the references' rows; the rest is in the JSON."""
    numbers = ("hit rate", "TTFT p50", "p90", "p99", "queue", "GPU-s", "balance")
    table = make_table(
        column("policy"),
        *(column(name, justify="right") for name in numbers),
        title=f"kvindex simulate: {report.params.get('source', '')}",
    )
    for p in report.policies:
        table.add_row(
            p.policy,
            f"{p.hit_rate:.1%}",
            *(f"{v:.3f}" for v in (p.ttft_p50_s, p.ttft_p90_s, p.ttft_p99_s)),
            f"{p.queue_mean:.2f}/{p.queue_max}",
            f"{p.gpu_s_per_request:.3f}",
            f"{p.imbalance:.2f}",
        )
    for label, hit_rate in (
        ("oracle", report.ceiling_hit_rate),
        ("one LRU cache", report.single_cache_hit_rate),
    ):
        table.add_row(label, f"{hit_rate:.1%}", *("-" * 6))
    lines = [
        "oracle: one unbounded cache seeing every request in order; no policy beats it.",
        f"{INSTANT}: kv_aware knowing every cache at once; greedy, so beatable.",
        "TTFT in s; queue: waiting per replica, mean/max; GPU-s: busy GPU-seconds per",
        f"request; balance: requests per replica, max/mean. {report.wall_s:.1f} s wall.",
    ]
    rejected = sum(p.rejected for p in report.policies)
    if rejected:
        lines.append(f"{rejected} requests rejected: longer than a replica's KV cache.")
    return Group(table, Text("\n".join(lines)))


POLICY_COLOURS = {
    "round_robin": "tab:gray",
    "random": "tab:brown",
    "least_load": "tab:olive",
    "session_affinity": "tab:purple",
    "prefix_hash": "tab:orange",
    "kv_aware": "tab:blue",
    INSTANT: "tab:green",
}
_VARIANT_COLOURS = ("tab:red", "tab:cyan", "tab:pink", "black", "gold", "navy")


def policy_colours(labels: Sequence[str]) -> dict[str, str]:
    """A colour per label: the policy's own, or the next spare one for a variant."""
    spare = iter(_VARIANT_COLOURS * (len(labels) // len(_VARIANT_COLOURS) + 1))
    return {label: POLICY_COLOURS.get(label) or next(spare) for label in labels}


def fleet_caption(params: dict[str, Any]) -> str:
    p = params
    return (
        f"{p.get('requests', 0):,} requests · {p.get('replicas')} replicas x"
        f" {p.get('capacity_blocks', 0):,} blocks of {p.get('block_size')} tokens"
        f" · prefill {p.get('prefill_tps', 0):,.0f} tok/s · decode"
        f" {p.get('decode_tps', 0):g} tok/s per request · batch <= {p.get('max_running')}"
        f" · events {p.get('event_delay_s', 0):g} s late · load every"
        f" {p.get('load_interval_s', 0):g} s (0: each request) · speed x{p.get('speed', 1):g}"
    )


def plot(report: SimReport, path: Path) -> None:
    """A PNG of six panels, one colour per policy throughout."""
    plt = pyplot()
    stats = report.policies
    colours = policy_colours([p.policy for p in stats])
    fig, axes = plt.subplots(2, 3, figsize=(20, 10))
    (ax_hit, ax_ttft, ax_rate), (ax_kv, ax_cost, ax_time) = axes
    _hit_panel(ax_hit, report, colours)
    _ttft_panel(ax_ttft, stats, colours)
    rates = [f"{p.throughput_rps:.2f} req/s · {p.throughput_tps:,.0f} tok/s" for p in stats]
    _bars(ax_rate, stats, colours, [p.throughput_rps for p in stats], rates)
    ax_rate.set_xlabel("throughput (requests/s; tokens/s, prompt + output, in the label)")
    _kv_panel(ax_kv, stats, colours)
    _cost_panel(ax_cost, stats, colours)
    _timeline_panel(ax_time, stats, colours)
    fig.suptitle(f"kvindex simulate: {report.params.get('source', '')}", fontsize=14)
    fig.text(0.5, 0.935, fleet_caption(report.params), ha="center", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _bars(
    ax: Any,
    stats: Sequence[PolicyStats],
    colours: dict[str, str],
    values: Sequence[float],
    labels: Sequence[str],
    *,
    left: Sequence[float] | None = None,
    alpha: float = 1.0,
) -> None:
    """A bar per policy, ``labels`` at their ends (``left``: stacked after those, hatched)."""
    names = [p.policy for p in stats]
    style: dict[str, Any] = {"alpha": alpha}
    if left is not None:
        style = {"left": left, "hatch": "//", "alpha": 0.45}
    bars = ax.barh(range(len(stats)), values, color=[colours[n] for n in names], **style)
    if left is None:
        ax.set_yticks(range(len(stats)), names)
        ax.invert_yaxis()  # the first policy on top, as in the table
    ax.bar_label(bars, labels=labels, padding=3, fontsize=9)
    ends = [v + (left[i] if left is not None else 0.0) for i, v in enumerate(values)]
    ax.set_xlim(0, max(ends, default=0.0) * 1.6 or 1.0)


def _ticks(ax: Any, values: Sequence[float], label: str | None = None) -> None:
    ax.scatter(values, range(len(values)), color="black", marker="|", s=300, zorder=3, label=label)


def _hit_panel(ax: Any, report: SimReport, colours: dict[str, str]) -> None:
    stats = report.policies
    hits = [p.hit_rate for p in stats]
    _bars(ax, stats, colours, hits, [f"{h:.1%}" for h in hits])
    ceiling, single = report.ceiling_hit_rate, report.single_cache_hit_rate
    ax.axvline(ceiling, color="black", linestyle="--", linewidth=1, zorder=0)
    ax.axvline(single, color="dimgray", linestyle=":", linewidth=1.5, zorder=0)
    ax.set_xlim(0, max(ceiling, single, *hits) * 1.3 or 1.0)
    ax.set_xlabel(
        f"hit rate (token-weighted) · oracle {ceiling:.1%} (dashed)"
        f" · one LRU cache {single:.1%} (dotted)"
    )


def _ttft_panel(ax: Any, stats: Sequence[PolicyStats], colours: dict[str, str]) -> None:
    labels = [f"p90 {p.ttft_p90_s:.2f} s · p50 {p.ttft_p50_s:.2f} s" for p in stats]
    _bars(ax, stats, colours, [p.ttft_p90_s for p in stats], labels)
    _ticks(ax, [p.ttft_p50_s for p in stats], "p50")
    ax.set_xlabel("time to first token, p90 (bar) and p50 (tick), s")
    ax.legend(loc="lower right")


def _kv_panel(ax: Any, stats: Sequence[PolicyStats], colours: dict[str, str]) -> None:
    labels = [f"mean {p.kv_usage_mean:.1%} · p90 {p.kv_usage_p90:.1%}" for p in stats]
    p90s = [p.kv_usage_p90 for p in stats]
    _bars(ax, stats, colours, p90s, labels, alpha=0.35)
    means = [p.kv_usage_mean for p in stats]
    ax.barh(range(len(stats)), means, color=[colours[p.policy] for p in stats])
    ax.set_xlabel("KV-cache usage (used / capacity): mean (solid), p90 (light)")


def _cost_panel(ax: Any, stats: Sequence[PolicyStats], colours: dict[str, str]) -> None:
    prefill = [p.prefill_gpu_s_per_request for p in stats]
    _bars(ax, stats, colours, prefill, [""] * len(stats))
    totals = [
        f"{p.gpu_s_per_request:.3f} ({p.prefill_gpu_s_per_request:.3f} prefill"
        f" + {p.decode_gpu_s_per_request:.3f} decode)"
        for p in stats
    ]
    _bars(ax, stats, colours, [p.decode_gpu_s_per_request for p in stats], totals, left=prefill)
    ax.set_xlabel("cost per task: GPU-seconds per request, prefill (solid) + decode (hatched)")


def _timeline_panel(ax: Any, stats: Sequence[PolicyStats], colours: dict[str, str]) -> None:
    # kv_aware thick, kv_aware_instant dashed over it: both visible where they agree
    for p in stats:
        if not p.hit_rate_timeline:
            continue
        xs, ys = zip(*p.hit_rate_timeline, strict=True)
        instant, kv = p.policy == INSTANT, p.policy == "kv_aware"
        ax.plot(
            xs,
            ys,
            label=p.policy,
            color=colours[p.policy],
            linestyle="--" if instant else "-",
            linewidth=3.5 if kv else 1.5,
            zorder=5 if instant else (4 if kv else 2),
        )
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize="small")
