"""Read-path benchmark: lookup + score in-process on each store, then HTTP ``POST /score``.

Usage (from the repository root)::

    .venv/bin/python bench/score.py --quick             # well under a minute
    .venv/bin/python bench/score.py                     # 1,000,000 blocks over 32 replicas
    .venv/bin/python bench/score.py --backends memory --parts lookup --profile 300
    .venv/bin/python bench/score.py --redis-url redis://127.0.0.1:PORT/0 --backends redis
    .venv/bin/python bench/score.py --backends redis --cluster     # a private 3-master cluster
    .venv/bin/python bench/score.py --url http://127.0.0.1:8000 --backends memory \\
        --events tcp://127.0.0.1:5557                  # an API already running (bind mode)

The index (``score_fill.py``): ``--blocks`` blocks over ``--replicas`` replicas, system
prompts shared by groups of replicas and per-replica conversation chains. The measured
prompt has 8,192 token ids (512 blocks): it matches a long prefix on a few replicas, the
system prompt on some, nothing on the rest. Every measured answer is checked against
that, and before measuring, one probe per replica group (its system prompt alone, which
each replica of the group matches) shows that every replica's stream is looked up.

``lookup`` (per backend): the ``Scorer`` that ``POST /score`` runs, called in-process with a
decoded ``ScoreRequest`` of 8,192 token ids: block keys, the longest-prefix lookup over all
replicas' streams (through the API's timing wrapper, off the loop for Redis as in the API),
the load of every replica, ``kv_aware`` scoring and the response struct. The registry holds
a live status per stream and every replica has a pushed load, as in a running fleet.
``keys_p50_ms`` and ``index_p50_ms`` time ``block_keys`` and the index lookup the scorer makes
(``holders_of(index)`` over every replica's stream: its holders alone) by themselves;
``longest_prefix_p50_ms`` times ``index.longest_prefix`` (a match per stream asked), which the
scorer no longer calls.
The memory index is filled with ``index.apply_many`` (STORE ops as the indexer makes them),
the Redis one with ``RedisIndex.apply_many`` under the prefix the API uses.

``http`` (per backend, per input ``token_ids`` / ``block_keys``, at concurrency 1 and 16):
``kvindex serve`` on free loopback ports with one ``--replica`` flag per replica, or the API
at ``--url`` (which must then hold this fleet: publish it with ``--events``). A memory-store
API is filled the way a fleet fills it, by vLLM-format events over ZeroMQ into its bound
SUB; a Redis-store API reads the Redis filled for ``lookup``, and each stream is made live
by one empty batch. Every replica's load is pushed with ``POST /load``. Request bodies are
encoded once; each connection is a raw keep-alive socket; the warm-up is not timed.
``client_cpu_*`` is this process's CPU over the timed part and ``server_cpu_*`` the API
process's (from /proc), so a client competing with the server for the cores shows.

With a private Redis, ``redis_*`` fields are Redis's own account per request (INFO cpu and
commandstats, warm-up included): its CPU, the time inside commands, the calls by command;
``--cluster`` runs the Redis backend on a private 3-master Redis Cluster instead (the same
fill and checks; the account summed over the masters).
``--profile N`` prints a cProfile of N in-process lookups (and of N bare index lookups) to
stderr; ``--server-profile DIR`` samples the API with py-spy during every HTTP run (py-spy
pauses the process at each sample, so those runs are slower: measure without it).

One JSON line per measurement goes to stdout; everything else to stderr. Percentiles are
nearest-rank over every timed request.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import logging
import os
import pstats
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
from machine import calibration_ms, host_load
from redis.cluster import RedisCluster
from redis_server import free_port, private_cluster, private_redis
from score_fill import BLOCK_SIZE, MODEL, NUM_GROUPS, Fleet, FleetConfig
from score_http import (
    Api,
    LoadPlan,
    LoadResult,
    announce,
    api_process,
    event_batches,
    get_json,
    http_call,
    publish_fill,
    py_spy,
    report_loads,
    run_load,
    score_request_bytes,
    stack_summary,
)

from kvindex.api.config.settings import ApiSettings
from kvindex.api.http.metrics import ApiMetrics, TimedIndex
from kvindex.api.load.model import Load
from kvindex.api.load.store import LoadStore, MemoryLoadStore, RedisLoadStore
from kvindex.api.schemas import LoadReport, ScoreRequest, ScoreResponse
from kvindex.api.score import Scorer
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.domain.keys import block_keys
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import BatchOps, BlockIndex, holders_of
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.redis.connection import connect
from kvindex.indexer.redis.schema import Schema

FULL_BLOCKS = 1_000_000
QUICK_BLOCKS = 131_072
EVENTS_PER_BATCH = 4
"""``BlockStored`` events per published batch (one scheduler step)."""
REDIS_BATCHES_PER_CALL = 32
MEMORY_BATCHES_PER_CALL = 1 << 20
DEFAULT_PREFIX = "kvindex"

log = logging.getLogger("kvindex.bench")


@dataclass(frozen=True, slots=True)
class BenchArgs:
    quick: bool
    backends: tuple[str, ...]
    parts: tuple[str, ...]
    redis_url: str | None
    cluster: bool
    """The private Redis is a 3-master Redis Cluster."""
    url: str | None
    events: str | None
    replicas: int
    blocks: int
    seed: int
    iterations: int
    top_k: int | None
    """The requests' ``top_k`` (None: not sent, the API's ``default_top_k``)."""
    profile: int
    server_profile: Path | None
    plans: tuple[LoadPlan, ...]


def _plans(quick: bool) -> tuple[LoadPlan, ...]:
    if quick:
        return (LoadPlan(1, 30, 300, 5.0), LoadPlan(16, 5, 400, 3.0))
    return (LoadPlan(1, 100, 2_000, 20.0), LoadPlan(16, 20, 2_000, 10.0))


def parse_args(argv: list[str] | None = None) -> BenchArgs:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help=f"{QUICK_BLOCKS:,} blocks, fewer requests")
    add("--backends", default="memory,redis", help="comma-separated: memory, redis")
    add("--parts", default="lookup,http", help="comma-separated: lookup, http")
    add("--redis-url", help="use this Redis (fresh key prefix, removed after), not a private one")
    add("--cluster", action="store_true", help="the private Redis is a 3-master Redis Cluster")
    add("--url", help="measure this running API (no process started; see --events)")
    add("--events", help="with --url: publish the fleet to the API's bound SUB here first")
    add("--replicas", type=int, default=32)
    add("--blocks", type=int, help=f"blocks in the index (default {FULL_BLOCKS:,})")
    add("--seed", type=int, default=0)
    add("--iterations", type=int, help="in-process lookups timed (default 500, quick 200)")
    add("--top-k", type=int, help="top_k of every /score request (0: all; default: not sent)")
    add("--profile", type=int, default=0, help="cProfile this many lookups per backend")
    add("--server-profile", type=Path, help="py-spy the API during each run; stacks here")
    ns = parser.parse_args(argv)
    backends = tuple(b.strip() for b in ns.backends.split(",") if b.strip())
    parts = tuple(p.strip() for p in ns.parts.split(",") if p.strip())
    if not backends or not set(backends) <= {"memory", "redis"}:
        parser.error("--backends: memory and/or redis")
    if not parts or not set(parts) <= {"lookup", "http"}:
        parser.error("--parts: lookup and/or http")
    if ns.top_k is not None and ns.top_k < 0:
        parser.error("--top-k: 0 (every candidate) or more")
    if ns.url is not None and len(backends) != 1:
        parser.error("--url: name the API's one backend with --backends")
    if ns.cluster and (ns.redis_url is not None or "redis" not in backends):
        parser.error("--cluster: a private cluster for the redis backend (not with --redis-url)")
    blocks = ns.blocks or (QUICK_BLOCKS if ns.quick else FULL_BLOCKS)
    iterations = ns.iterations or (200 if ns.quick else 500)
    return BenchArgs(
        ns.quick, backends, parts, ns.redis_url, ns.cluster, ns.url, ns.events, ns.replicas, blocks,
        ns.seed, iterations, ns.top_k, ns.profile, ns.server_profile, _plans(ns.quick),
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where the Redis backend lives, and the key prefix the fill and the API use."""

    url: str
    prefix: str
    private: bool


# --- numbers ----------------------------------------------------------------------------------


def percentile_ms(latencies_ns: Sequence[int], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100), in milliseconds."""
    ordered = sorted(latencies_ns)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return round(ordered[rank - 1] / 1e6, 3)


def summary(latencies_ns: Sequence[int]) -> dict[str, Any]:
    return {
        "p50_ms": percentile_ms(latencies_ns, 50),
        "p99_ms": percentile_ms(latencies_ns, 99),
        "mean_ms": round(sum(latencies_ns) / len(latencies_ns) / 1e6, 3),
        "max_ms": percentile_ms(latencies_ns, 100),
    }


def emit(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


# --- the fleet's loads and the measured requests ----------------------------------------------


def fleet_loads(fleet: Fleet, seed: int) -> dict[str, LoadReport]:
    """A pushed load per replica: some busy, some idle (deterministic per seed)."""
    rng = random.Random(f"kvindex-bench/{seed}/load")
    now = time.time()
    return {
        r: LoadReport(
            replica=r,
            running=float(rng.randint(0, 48)),
            waiting=float(rng.randint(0, 6)),
            kv_usage=round(rng.random(), 3),
            ts=now,
        )
        for r in fleet.replica_ids
    }


def put_loads(store: LoadStore, reports: dict[str, LoadReport]) -> None:
    for replica, r in reports.items():
        assert r.ts is not None
        store.put(replica, Load(r.running, r.waiting, r.kv_usage, r.ts, "push"))


def score_fields(top_k: int | None) -> dict[str, Any]:
    """What every measured request adds to its prompt: ``top_k`` when one is asked for."""
    return {} if top_k is None else {"top_k": top_k}


def request_bodies(fleet: Fleet, top_k: int | None) -> dict[str, bytes]:
    """``POST /score`` bodies by input kind, encoded once (as the project's client does)."""
    tokens = fleet.prompt_tokens()
    keys = block_keys(MODEL, tokens, BLOCK_SIZE)
    extra = score_fields(top_k)
    return {
        "token_ids": msgspec.json.encode({"model": MODEL, "token_ids": tokens, **extra}),
        "block_keys": msgspec.json.encode({"model": MODEL, "block_keys": keys, **extra}),
    }


def check_answer(answer: ScoreResponse, expected: dict[str, int], where: str) -> ScoreResponse:
    """Raise unless the answer counts every replica as a candidate, counts those whose cache
    holds some of the prompt as matched, and gives each entry it has (the best ``top_k``)
    the prefix its replica's cache holds."""
    matched = {e.replica: e.matched_blocks for e in answer.scores}
    wrong = {r: (n, expected.get(r)) for r, n in matched.items() if expected.get(r) != n}
    num_matched = sum(1 for n in expected.values() if n)
    counts = (answer.num_candidates, answer.num_matched)
    if wrong or counts != (len(expected), num_matched) or answer.degraded is not None:
        raise RuntimeError(
            f"{where}: (matched, expected) differ on {wrong}; (candidates, matched) {counts}"
            f" for {(len(expected), num_matched)}; {answer.degraded}"
        )
    return answer


def check_lookups(fleet: Fleet, score: Callable[[list[int]], ScoreResponse], where: str) -> None:
    """One probe per replica group (its system prompt): each replica matches 64 blocks on
    its group's probe, so every replica's stream is shown to be looked up (counted in
    ``num_matched``, and checked in every entry the answer explains)."""
    for group in range(min(NUM_GROUPS, fleet.config.replicas)):
        answer = score(fleet.probe_tokens(group))
        check_answer(answer, fleet.probe_expected(group), f"{where} probe {group}")


def matched_summary(answer: ScoreResponse) -> dict[str, Any]:
    """``replicas_matched`` counts every candidate; ``matched_blocks`` lists the entries'."""
    blocks = sorted((e.matched_blocks for e in answer.scores if e.matched_blocks), reverse=True)
    return {
        "replicas_matched": answer.num_matched,
        "matched_blocks": blocks,
        "entries": len(answer.scores),
    }


# --- filling the index directly -----------------------------------------------------------------


def index_batches(fleet: Fleet, i: int, ts: float) -> list[BatchOps]:
    """Replica ``i``'s cache as the indexer would apply it: one batch per scheduler step."""
    steps = event_batches(fleet.chunks(i), EVENTS_PER_BATCH)
    return [
        (seq, ts, [op for chunk in step for op in chunk.ops()]) for seq, step in enumerate(steps)
    ]


def fill_index(index: BlockIndex, fleet: Fleet, per_call: int) -> dict[str, int]:
    """Every replica's cache into ``index``; returns the batches (seqs) used per replica."""
    started = time.perf_counter()
    num_batches: dict[str, int] = {}
    for i, replica in enumerate(fleet.replica_ids):
        batches = index_batches(fleet, i, time.time())
        for start in range(0, len(batches), per_call):
            index.apply_many(StreamId(replica), batches[start : start + per_call])
        num_batches[replica] = len(batches)
    held = sum(index.stats(StreamId(r)).num_blocks for r in fleet.replica_ids)
    if held != fleet.num_blocks:
        raise RuntimeError(f"the index holds {held} blocks, {fleet.num_blocks} were stored")
    seconds = time.perf_counter() - started
    log.info("filled %s: %d blocks, %d batches in %.1fs", type(index).__name__, held,
             sum(num_batches.values()), seconds)  # fmt: skip
    return num_batches


# --- lookup: the Scorer in-process ------------------------------------------------------------


def live_registry(fleet: Fleet, num_batches: dict[str, int]) -> Registry:
    """The registry a running API holds: every replica, every stream live at its last seq."""
    registry = Registry(tuple(ReplicaSpec(id=r, model=MODEL) for r in fleet.replica_ids))
    for replica, count in num_batches.items():
        stream = StreamId(replica)
        heard = StreamReport(block_size=BLOCK_SIZE, last_seq=count - 1, last_event_ts=time.time())
        registry.record(stream, heard)
    return registry


def api_scorer(
    index: BlockIndex, registry: Registry, loads: LoadStore, *, blocking: bool
) -> Scorer:
    """The Scorer as ``create_app`` builds it (the index behind the timing wrapper)."""
    metrics = ApiMetrics(registry, index)
    timed = TimedIndex(index, metrics.lookup_latency)
    return Scorer(
        ApiSettings(), timed, registry, loads, tokenizers=lambda _: None, blocking_store=blocking
    )


async def _time_scores(scorer: Scorer, request: ScoreRequest, n: int, warmup: int = 0) -> list[int]:
    """Latencies (ns) of ``n`` scores after ``warmup`` untimed ones, on one event loop."""
    for _ in range(warmup):
        await scorer.score(request)
    clock = time.perf_counter_ns
    out = []
    for _ in range(n):
        started = clock()
        await scorer.score(request)
        out.append(clock() - started)
    return out


def in_process(scorer: Scorer, top_k: int | None) -> Callable[[list[int]], ScoreResponse]:
    def score(tokens: list[int]) -> ScoreResponse:
        request = ScoreRequest(model=MODEL, token_ids=tokens, top_k=top_k)
        return asyncio.run(scorer.score(request))

    return score


def time_calls(fn: Callable[[], object], n: int) -> list[int]:
    clock = time.perf_counter_ns
    out = []
    for _ in range(n):
        started = clock()
        fn()
        out.append(clock() - started)
    return out


def profile_scores(
    scorer: Scorer, request: ScoreRequest, index_call: Callable[[], object], n: int, backend: str
) -> None:
    """cProfile ``n`` scores, then ``n`` bare index lookups (for Redis the scorer runs the
    lookup in a worker thread, which the first profile does not see); to stderr."""
    runs: list[tuple[str, Callable[[], object]]] = [
        ("lookup+score", lambda: asyncio.run(_time_scores(scorer, request, n))),
        ("index holders lookup", lambda: time_calls(index_call, n)),
    ]
    for what, run in runs:
        profiler = cProfile.Profile()
        profiler.enable()
        run()
        profiler.disable()
        print(f"--- cProfile: {n} in-process {what}, {backend} ---", file=sys.stderr)
        stats = pstats.Stats(profiler, stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(25)


def redis_account(target: RedisTarget | None) -> dict[str, tuple[int, int]] | None:
    """A private Redis's own account: (calls, µs) per command, and ``cpu`` as (0, CPU µs),
    summed over the masters of a cluster. None for a shared Redis (other clients' work
    would be counted)."""
    if target is None or not target.private:
        return None
    client = connect(target.url)
    try:
        stats_of: list[dict[str, Any]]
        cpu_of: list[dict[str, Any]]
        if isinstance(client, RedisCluster):
            primaries = client.PRIMARIES
            stats_of = list(client.info("commandstats", target_nodes=primaries).values())
            cpu_of = list(client.info("cpu", target_nodes=primaries).values())
        else:
            stats_of, cpu_of = [client.info("commandstats")], [client.info("cpu")]
    finally:
        client.close()
    out: dict[str, tuple[int, int]] = {}
    for stats in stats_of:
        for k, v in stats.items():
            calls, micros = out.get(k.removeprefix("cmdstat_"), (0, 0))
            out[k.removeprefix("cmdstat_")] = (calls + int(v["calls"]), micros + int(v["usec"]))
    used = sum(float(c["used_cpu_user"]) + float(c["used_cpu_sys"]) for c in cpu_of)
    out["cpu"] = (0, round(1e6 * used))
    return out


def redis_used(
    before: dict[str, tuple[int, int]] | None, after: dict[str, tuple[int, int]] | None, n: int
) -> dict[str, Any]:
    """Per request: Redis CPU, time inside commands, and calls by command."""
    if before is None or after is None:
        return {}
    commands = [k for k in after if k not in ("cpu", "info")]
    calls = {k: (after[k][0] - before.get(k, (0, 0))[0]) / n for k in commands}
    micros = sum(after[k][1] - before.get(k, (0, 0))[1] for k in commands)
    return {
        "redis_cpu_ms_per_request": round((after["cpu"][1] - before["cpu"][1]) / n / 1e3, 3),
        "redis_command_ms_per_request": round(micros / n / 1e3, 3),
        "redis_calls_per_request": {
            k: round(v, 2) for k, v in sorted(calls.items()) if round(v, 2)
        },
    }


def run_lookup(
    args: BenchArgs,
    fleet: Fleet,
    index: BlockIndex,
    scorer: Scorer,
    target: RedisTarget | None = None,
) -> dict[str, Any]:
    backend = "memory" if target is None else "redis"
    tokens = fleet.prompt_tokens()
    score = in_process(scorer, args.top_k)
    check_lookups(fleet, score, f"lookup {backend}")
    answer = check_answer(score(tokens), fleet.expected(), f"lookup {backend}")
    request = ScoreRequest(model=MODEL, token_ids=tokens, top_k=args.top_k)
    keys = block_keys(MODEL, tokens, BLOCK_SIZE)
    streams = [StreamId(r) for r in fleet.replica_ids]
    gc.collect()
    warmup = max(10, args.iterations // 10)
    asyncio.run(_time_scores(scorer, request, 0, warmup))
    before = redis_account(target)
    latencies = asyncio.run(_time_scores(scorer, request, args.iterations))
    used = redis_used(before, redis_account(target), args.iterations)
    keys_ns = time_calls(lambda: block_keys(MODEL, tokens, BLOCK_SIZE), args.iterations)
    holders, asked = holders_of(index), tuple(sorted(streams))  # as the scorer asks
    index_ns = time_calls(lambda: holders(keys, asked), args.iterations)
    prefix_ns = time_calls(lambda: index.longest_prefix(keys, streams), args.iterations)
    if args.profile:
        index_call = partial(holders, keys, asked)
        profile_scores(scorer, request, index_call, args.profile, backend)
    return {
        "bench": "lookup",
        "backend": backend,
        **summary(latencies),
        "keys_p50_ms": percentile_ms(keys_ns, 50),
        "index_p50_ms": percentile_ms(index_ns, 50),
        "longest_prefix_p50_ms": percentile_ms(prefix_ns, 50),
        **used,
        "iterations": args.iterations,
        "replicas": fleet.config.replicas,
        "blocks": fleet.num_blocks,
        "prompt_tokens": len(tokens),
        "top_k": args.top_k,
        **matched_summary(answer),
    }


def lookup_memory(args: BenchArgs, fleet: Fleet, reports: dict[str, LoadReport]) -> dict[str, Any]:
    index = MemoryIndex()
    num_batches = fill_index(index, fleet, per_call=MEMORY_BATCHES_PER_CALL)
    loads = MemoryLoadStore()
    put_loads(loads, reports)
    scorer = api_scorer(index, live_registry(fleet, num_batches), loads, blocking=False)
    line = run_lookup(args, fleet, index, scorer)
    del index, scorer
    gc.collect()
    return line


def fill_redis(target: RedisTarget, fleet: Fleet, reports: dict[str, LoadReport]) -> dict[str, int]:
    """Every replica's cache and load into Redis, under the prefix the API will use."""
    index = RedisIndex(connect(target.url), Schema(target.prefix))
    try:
        if target.private:
            index.client.flushall()
        put_loads(RedisLoadStore(index.client, Schema(target.prefix)), reports)
        return fill_index(index, fleet, per_call=REDIS_BATCHES_PER_CALL)
    finally:
        index.close()


def lookup_redis(
    args: BenchArgs, target: RedisTarget, fleet: Fleet, num_batches: dict[str, int]
) -> dict[str, Any]:
    index = RedisIndex(connect(target.url), Schema(target.prefix))
    try:
        loads = RedisLoadStore(index.client, Schema(target.prefix))
        scorer = api_scorer(index, live_registry(fleet, num_batches), loads, blocking=True)
        return run_lookup(args, fleet, index, scorer, target)
    finally:
        index.close()


# --- http: POST /score against an API process ---------------------------------------------------


def over_http(api: Api, top_k: int | None) -> Callable[[list[int]], ScoreResponse]:
    def score(tokens: list[int]) -> ScoreResponse:
        body = msgspec.json.encode({"model": MODEL, "token_ids": tokens, **score_fields(top_k)})
        status, reply = http_call(api, "POST", "/score", body)
        if status != 200:
            raise RuntimeError(f"POST /score: HTTP {status}: {reply[:300]!r}")
        return msgspec.json.decode(reply, type=ScoreResponse)

    return score


def http_line(result: LoadResult, plan: LoadPlan, input_kind: str, backend: str) -> dict[str, Any]:
    n = len(result.latencies_ns)
    line: dict[str, Any] = {
        "bench": "http",
        "backend": backend,
        "input": input_kind,
        "concurrency": plan.concurrency,
        "rps": round(n / result.seconds, 1),
        **summary(result.latencies_ns),
        "requests": n,
        "seconds": round(result.seconds, 2),
        "errors": result.num_errors,
        "client_cpu_ms_per_request": round(1e3 * result.client_cpu_s / n, 3),
        "client_cpu_share": round(result.client_cpu_s / result.seconds, 2),
    }
    if result.server_cpu_s is not None:
        line["server_cpu_ms_per_request"] = round(1e3 * result.server_cpu_s / n, 3)
        line["server_cpu_share"] = round(result.server_cpu_s / result.seconds, 2)
    return line


def measure_http(
    api: Api, fleet: Fleet, args: BenchArgs, backend: str, target: RedisTarget | None
) -> Iterator[dict[str, Any]]:
    for input_kind, body in request_bodies(fleet, args.top_k).items():
        request = score_request_bytes(api, body)
        for plan in args.plans:
            account = target if backend == "redis" else None
            before = redis_account(account)
            stacks = sampled(args, f"{backend}-{input_kind}-c{plan.concurrency}")
            with py_spy(api.pid, stacks):
                result = run_load(api, request, plan)
            used = redis_used(before, redis_account(account), result.num_requests)
            if stacks is not None and stacks.exists():
                log.info("--- py-spy of the API, %s ---\n%s", stacks.name, stack_summary(stacks))
            answer = msgspec.json.decode(result.sample_body, type=ScoreResponse)
            answer = check_answer(answer, fleet.expected(), f"http {backend} {input_kind}")
            line = http_line(result, plan, input_kind, backend)
            line.update(**used, body_bytes=len(body), top_k=args.top_k)
            line.update(reply_bytes=len(result.sample_body), **matched_summary(answer))
            yield line


def sampled(args: BenchArgs, name: str) -> Path | None:
    """Where py-spy writes the API's stacks for one run (None: not sampled)."""
    if args.server_profile is None:
        return None
    args.server_profile.mkdir(parents=True, exist_ok=True)
    return args.server_profile / f"{name}.txt"


def serve_config(directory: Path, prefix: str) -> Path:
    path = directory / "kvindex.toml"
    path.write_text(f'redis_prefix = "{prefix}"\nlog_level = "WARNING"\n')
    return path


@contextmanager
def started_api(
    backend: str, fleet: Fleet, target: RedisTarget | None, workdir: Path
) -> Iterator[Api]:
    prefix = target.prefix if target is not None else DEFAULT_PREFIX
    with api_process(
        backend,
        fleet.replica_ids,
        config=serve_config(workdir, prefix),
        redis_url=None if target is None else target.url,
        ports=(free_port(), free_port()),
    ) as api:
        yield api


def prepare_api(
    api: Api, fleet: Fleet, backend: str, num_batches: dict[str, int] | None
) -> dict[str, Any]:
    """Fill (memory) or make live (Redis, filled directly) what the API serves; its /stats."""
    if backend == "memory" and api.events is not None:
        return publish_fill(api, fleet, EVENTS_PER_BATCH)
    if backend == "redis" and api.events is not None and num_batches is not None:
        return announce(api, fleet, num_batches)
    log.warning("the API at %s is measured as it is (nothing published to it)", api.url)
    return get_json(api, "/stats")


def run_http(
    args: BenchArgs,
    fleet: Fleet,
    backend: str,
    target: RedisTarget | None,
    num_batches: dict[str, int] | None,
) -> Iterator[dict[str, Any]]:
    with ExitStack() as stack:
        if args.url is not None:
            api = Api(args.url, args.events, None)
            num_batches = None  # its Redis (if any) is not the one filled here
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvbench-")))
            api = stack.enter_context(started_api(backend, fleet, target, workdir))
        stats = prepare_api(api, fleet, backend, num_batches)
        log.info("API %s (%s): %s", api.url, backend, stats)
        report_loads(api, fleet_loads(fleet, args.seed))
        check_lookups(fleet, over_http(api, args.top_k), f"http {backend}")
        yield from measure_http(api, fleet, args, backend, target)


# --- driving ---------------------------------------------------------------------------------


@contextmanager
def redis_target(args: BenchArgs) -> Iterator[RedisTarget | None]:
    """A private redis-server (flushed, default prefix), or ``--redis-url`` under a fresh
    prefix whose keys are deleted afterwards; None when no backend needs Redis."""
    if "redis" not in args.backends or (args.url is not None and "lookup" not in args.parts):
        yield None
        return
    if args.redis_url is not None:
        target = RedisTarget(args.redis_url, f"kvbench-score-{os.getpid()}", private=False)
        try:
            yield target
        finally:
            drop_prefix(target)
        return
    with private_cluster() if args.cluster else private_redis() as url:
        log.info("private redis %s at %s", "cluster" if args.cluster else "server", url)
        yield RedisTarget(url, DEFAULT_PREFIX, private=True)


def drop_prefix(target: RedisTarget) -> None:
    client = connect(target.url)
    try:
        for key in client.scan_iter(match=f"{target.prefix}:*", count=1_000):
            client.delete(key)
    finally:
        client.close()


def run_backend(
    args: BenchArgs, fleet: Fleet, backend: str, target: RedisTarget | None
) -> Iterator[dict[str, Any]]:
    reports = fleet_loads(fleet, args.seed)
    num_batches = None
    if backend == "memory" and "lookup" in args.parts:
        yield lookup_memory(args, fleet, reports)
    if backend == "redis" and target is not None:
        num_batches = fill_redis(target, fleet, reports)
        if "lookup" in args.parts:
            yield lookup_redis(args, target, fleet, num_batches)
    if "http" in args.parts:
        yield from run_http(args, fleet, backend, target, num_batches)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    args = parse_args(argv)
    fleet = Fleet(FleetConfig(args.replicas, args.blocks, args.seed))
    log.info("fleet: %d replicas, %d blocks; expected matches %s", fleet.config.replicas,
             fleet.num_blocks, fleet.expected())  # fmt: skip
    machine = {"calibration_ms": calibration_ms(), "cluster": args.cluster}
    with redis_target(args) as target:
        for backend in args.backends:
            for line in run_backend(args, fleet, backend, target):
                emit({**line, "quick": args.quick, "host_load_1m": host_load(), **machine})
    return 0


if __name__ == "__main__":
    sys.exit(main())
