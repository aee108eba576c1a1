"""Ingest benchmark: real vLLM KV-event frames through the write path into each index.

Usage (from the repository root)::

    .venv/bin/python bench/ingest.py --quick            # well under a minute
    .venv/bin/python bench/ingest.py                    # >= 1,000,000 entries in Redis
    .venv/bin/python bench/ingest.py --redis-url redis://127.0.0.1:PORT/0 --backends redis
    .venv/bin/python bench/ingest.py --quick --drain 1  # a subscriber with nothing queued
    .venv/bin/python bench/ingest.py --quick --backends redis --indexers 1,2  # sharded
    .venv/bin/python bench/ingest.py --quick --backends memory,memory-python
    .venv/bin/python bench/ingest.py --quick --backends memory --workers 1,2  # over ZeroMQ
    .venv/bin/python bench/ingest.py --quick --backends memory --workers 1,2 --coalesce 32

What is timed, per backend: every pre-generated frame (see ``workload.py``), interleaved
across replicas by engine timestamp, through ``Pipeline.handle_frames`` (the subscriber
without its sockets) — wire decoding, per-stream ordering, key computation, the index write
and the registry's bookkeeping — about ``--drain`` (default 16) messages per replica per
call, as the subscriber's socket loop hands them over when messages queue up. That saturated
case is the one that bounds how many events per second the indexer keeps up with: a
subscriber that keeps up easily finds one message per wake (``--drain 1``:
``Pipeline.handle_live``, and a Redis round trip per batch).
Generation, index construction and the checks afterwards are not timed.

A replica's first frame is passed with ``stream=None``: the pipeline registers the stream
from its topic ``kv@<replica>@<model>``. Later frames carry the replica's ``StreamId``, as
a connect-mode socket would. (No subscriber opens a socket for the replica, so the pipeline
creates its stream state only on that first topic-identified frame.)

Counts: ``blocks`` = block hashes named by all events (stored + removed: one index
operation each); ``blocks_stored`` alone gives ``stored_blocks_per_s``. ``entries`` =
(block, replica) pairs resident at the end, summed from ``index.stats``; for Redis,
``bytes_per_entry`` = growth of INFO ``used_memory`` during the run / ``entries``; for the
memory store, what dropping the filled index frees (``tracemalloc``, over one more run that
is not timed: the pipeline is dropped first, so only what the index alone holds counts) /
``entries``, and ``compiled`` says whether its tables were the compiled ones. The
``memory-python`` backend is the memory store on the Python oracle of its tables
(``tests.oracles.tables``; the compiled ingest path then does not serve).

``--indexers N[,M...]`` (Redis): each count is a run of that many sharded indexers on one
Redis, each a process of its own (forked, sharing the pre-generated frames) with its own
pipeline over a fenced ``RedisIndex``, handed the frames of the streams it owns by the
rendezvous hash (``kvindex.indexer.ingest.membership``), started together; timed from the start
to the last one's end. Such a line adds ``indexers``, ``cpu_s_per_indexer`` (each
process's user + system CPU in the timed part), ``redis_cpu_s`` (the server's, from INFO
cpu) and ``cores_busy`` (all of that CPU / the wall time: at the machine's core count,
the run is CPU-bound and more processes cannot go faster). Without ``--indexers`` the
Redis run is the unsharded one, as before. ``--cluster``: the sharded runs on a private
3-master Redis Cluster instead (``redis_cpu_s`` summed over the masters).

``--workers N[,M...]``: the memory store behind the real subscriber over ZeroMQ, once per
count of ingest workers (``ingest_workers``), ``--repeat`` times each, the counts
alternated, the median reported (backend ``memory-zmq``). A forked publisher process binds
one PUB per replica on loopback (connect mode: the subscriber connects a SUB to each, as to
vLLM) and queues every frame on them before the subscriber's workers start (what does not
fit in the sockets' buffers waits in the publisher's unbounded send queue: nothing is
dropped, and its sending is not timed); timed from the workers' start until the registry
counts every batch applied. The line adds ``workers``, ``cpu_s`` (this process's user +
system CPU in the timed part: the workers, ZeroMQ's I/O threads, the timer's polling),
``cores_busy`` (that CPU / the wall time) and, from the second count on, ``speedup`` (the
first count's median time / this one's).

``--coalesce N``: each replica's messages merged N at a time into one (their events in order,
the last one's timestamp, seqs renumbered; placed where the last of them was), before
anything is timed: the same events in fewer, larger batches (``--coalesce 32`` on the quick
workload: about 295 blocks a batch instead of 9), for the write path's cost on large batches.
Lines add ``coalesce``.

``--lookup-wait``: while the memory store ingests (in process and over ZeroMQ), another
thread asks it one lookup per millisecond (an 8,192-token prompt's 512 keys over every
stream, as the API's ``/score`` does) and the line adds the lookups' ``lookup_p50_ms``,
``lookup_p99_ms`` and ``lookup_max_ms``: how long the API waits on the index lock while
ingest applies a backlog.

One JSON line per backend (and per indexer and worker count) goes to stdout; everything else
goes to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import multiprocessing
import os
import random
import resource
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import zmq
from machine import calibration_ms
from redis.cluster import RedisCluster
from redis_server import private_cluster, private_redis
from workload import MODEL, Workload, WorkloadConfig, build_workload, topic

from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.domain.events import EventBatch, StreamId, Topic
from kvindex.indexer.fleet.registry import Registry, fleet_totals
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.block_journal import BlockJournal, JournaledIndex
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import BlockIndex
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.ingest.membership import rendezvous_owner
from kvindex.indexer.ingest.pipeline import Pipeline
from kvindex.indexer.ingest.subscriber import Subscriber
from kvindex.indexer.ingest.wire import Encoding, decode_payload, encode_batch, encode_live
from kvindex.indexer.redis.connection import RedisClient, connect
from kvindex.indexer.redis.schema import Schema
from tests.oracles.tables import python_index

_BACKENDS = ("memory", "memory-python", "memory-dump", "redis")
FULL_ENTRIES = 1_000_000
QUICK_ENTRIES = 131_072
CAPACITY_MARGIN = 1.1
"""Cache blocks per resident entry wanted: partial and duplicate blocks are not entries."""
_SETTLE_S = 1.0
"""Pause before reading Redis memory, so incremental rehashing finishes."""

log = logging.getLogger("kvindex.bench")


@dataclass(frozen=True, slots=True)
class BenchArgs:
    quick: bool
    redis_url: str | None
    replicas: int
    encoding: Encoding
    repeat: int
    entries: int
    turnover: float
    backends: tuple[str, ...]
    seed: int
    jobs: int
    keep: bool
    drain: int
    indexers: tuple[int, ...] = ()
    """Sharded runs on Redis: one per count (empty: the unsharded run only)."""
    cluster: bool = False
    """The sharded runs on a private 3-master Redis Cluster."""
    workers: tuple[int, ...] = ()
    """Runs over ZeroMQ into the memory store, one per count of ingest workers."""
    lookup_wait: bool = False
    """Time lookups from another thread while the memory store ingests."""
    coalesce: int = 1
    """A replica's messages merged this many at a time into one (larger batches)."""


def parse_args(argv: list[str] | None = None) -> BenchArgs:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help=f"{QUICK_ENTRIES:,} entries instead of 1M")
    add("--redis-url", help="use this Redis (fresh key prefix, no flush), not a private one")
    add("--replicas", type=int, default=16, help="simulated vLLM replicas (default 16)")
    add("--encoding", choices=("map", "array"), default="map", help="map: vLLM 0.33; array: 0.23")
    add("--repeat", type=int, default=3, help="in-process runs; the median is reported")
    add("--entries", type=int, help="resident (block, replica) entries wanted at the end")
    add("--turnover", type=float, default=1.0, help="blocks stored beyond capacity, x capacity")
    add("--backends", default="memory,redis", help="comma-separated: memory, memory-python, redis")
    add("--seed", type=int, default=0)
    add("--jobs", type=int, default=0, help="processes generating the workload (0: auto)")
    add("--keep", action="store_true", help="leave the keys in the --redis-url Redis")
    add("--drain", type=int, default=16, help="messages per replica per socket wake (1: live)")
    add("--indexers", default="", help="redis: sharded runs of N indexer processes, e.g. 1,2")
    add("--cluster", action="store_true", help="the --indexers runs on a 3-master cluster")
    add("--workers", default="", help="memory over ZeroMQ: runs of N ingest workers, e.g. 1,2")
    add("--lookup-wait", action="store_true", help="memory: time lookups during ingest")
    add("--coalesce", type=int, default=1, help="merge each replica's messages N at a time")
    ns = parser.parse_args(argv)
    backends = tuple(b.strip() for b in ns.backends.split(",") if b.strip())
    if (
        not set(backends) <= set(_BACKENDS)
        or min(ns.replicas, ns.repeat, ns.drain, ns.coalesce) < 1
    ):
        parser.error(f"backends must be among {_BACKENDS}; replicas, repeat, drain, coalesce >= 1")
    try:
        indexers = tuple(int(n) for n in ns.indexers.split(",") if n.strip())
    except ValueError:
        parser.error(f"--indexers must be counts such as 1,2, got {ns.indexers!r}")
    if indexers and (min(indexers) < 1 or "redis" not in backends or ns.redis_url):
        parser.error("--indexers needs counts >= 1 and the redis backend (a private one)")
    if ns.cluster and not indexers:
        parser.error("--cluster is for the --indexers runs")
    try:
        workers = tuple(int(n) for n in ns.workers.split(",") if n.strip())
    except ValueError:
        parser.error(f"--workers must be counts such as 1,2, got {ns.workers!r}")
    if workers and min(workers) < 1:
        parser.error("--workers needs counts >= 1")
    entries = ns.entries or (QUICK_ENTRIES if ns.quick else FULL_ENTRIES)
    return BenchArgs(
        ns.quick, ns.redis_url, ns.replicas, ns.encoding, ns.repeat, entries, ns.turnover,
        backends, ns.seed, ns.jobs, ns.keep, ns.drain, indexers, ns.cluster, workers,
        ns.lookup_wait, ns.coalesce,
    )  # fmt: skip


def workload_config(args: BenchArgs) -> WorkloadConfig:
    capacity = math.ceil(args.entries * CAPACITY_MARGIN / args.replicas)
    return WorkloadConfig(
        replicas=args.replicas,
        capacity_blocks=max(capacity, 2_048),
        turnover=args.turnover,
        encoding=args.encoding,
        seed=args.seed,
    )


def generate(args: BenchArgs) -> Workload:
    config = workload_config(args)
    jobs = args.jobs or (1 if config.replicas * config.capacity_blocks < 500_000 else 2)
    started = time.perf_counter()
    workload = build_workload(config, time.time(), jobs=jobs)
    elapsed = time.perf_counter() - started
    num_batches = len(workload.frames)
    num_blocks = workload.num_blocks_stored + workload.num_blocks_removed
    log.info(
        "workload: %d replicas x %d cache blocks, %s encoding, generated in %.1fs (%d jobs)",
        config.replicas, config.capacity_blocks, config.encoding, elapsed, jobs,
    )  # fmt: skip
    log.info(
        "  %d batches, %d events, %d blocks (%d stored, %d removed), %.1f blocks and "
        "%.1f events per batch, prefix hit rate %.0f%%, %.0f MB of payload",
        num_batches, workload.num_events, num_blocks, workload.num_blocks_stored,
        workload.num_blocks_removed, num_blocks / num_batches,
        workload.num_events / num_batches, 100 * workload.prefix_hit_rate,
        workload.num_payload_bytes / 1e6,
    )  # fmt: skip
    return workload


def coalesced(workload: Workload, num_messages: int) -> Workload:
    """Each replica's messages ``num_messages`` at a time as one (their events in order,
    the last one's ts; seqs renumbered from 0), placed where the last of them was: the
    same events, fewer and larger batches. Not timed."""
    if num_messages == 1:
        return workload
    encoding = workload.config.encoding
    replica_of = {topic(t.replica): t.replica for t in workload.traces}
    held: dict[bytes, list[EventBatch]] = {}
    seq_of: dict[bytes, int] = {}
    frames: list[list[bytes]] = []
    streams: list[StreamId | None] = []

    def merge(name: bytes) -> None:
        batches = held.pop(name)
        events = [e for batch in batches for e in batch.events]
        payload = encode_batch(events, ts=batches[-1].ts, rank=batches[-1].rank, encoding=encoding)
        seq = seq_of[name] = seq_of.get(name, -1) + 1
        frames.append(encode_live(name, seq, payload))
        streams.append(None if seq == 0 else StreamId(replica_of[name], 0))

    for frame in workload.frames:
        batch = decode_payload(frame[2], 0)
        assert not batch.num_bad_events, "the generated workload has no bad event"
        group = held.setdefault(frame[0], [])
        group.append(batch)
        if len(group) == num_messages:
            merge(frame[0])
    for name in list(held):
        merge(name)
    return Workload(workload.config, frames, streams, workload.traces)


# --- the timed section --------------------------------------------------------------------


def new_pipeline(index: BlockIndex, workload: Workload) -> tuple[Pipeline, Registry]:
    """The write path without sockets, over ``index``, knowing every simulated replica."""
    specs = tuple(ReplicaSpec(id=t.replica, model=MODEL) for t in workload.traces)
    settings = IndexerSettings(replicas=specs, key_cache_size=_key_cache_size(index))
    registry = Registry(settings.replicas)
    return Pipeline(settings, index, registry), registry


def _key_cache_size(index: BlockIndex) -> int:
    """The key cache a real indexer keeps on this store (``key_cache_size`` -1 resolves by
    the settings' store, which the bench does not set: it hands the pipeline an index)."""
    if isinstance(index, RedisIndex):
        return IndexerSettings(store="redis").key_cache_entries
    return IndexerSettings(store="memory").key_cache_entries


Delivery = tuple[list[list[bytes]], StreamId | None]
"""Messages handed to the pipeline in one call, and the stream they came from."""


def deliveries(workload: Workload, drain: int) -> list[Delivery]:
    """How the frames reach the pipeline.

    ``drain == 1``: one frame per call, in arrival order. Otherwise the arrival order is cut
    into windows of ``drain * replicas`` frames, and each window is handed over replica by
    replica, as a poll loop that finds about ``drain`` messages queued on every replica's
    socket would (a subscriber running behind: the saturated case).
    """
    pairs = list(zip(workload.frames, workload.streams, strict=True))
    if drain == 1:
        return [([frame], stream) for frame, stream in pairs]
    window = drain * workload.config.replicas
    plan: list[Delivery] = []
    for start in range(0, len(pairs), window):
        by_topic: dict[bytes, Delivery] = {}
        for frame, stream in pairs[start : start + window]:
            by_topic.setdefault(frame[0], ([], stream))[0].append(frame)
        plan.extend(by_topic.values())
    return plan


def drive(pipeline: Pipeline, plan: list[Delivery]) -> float:
    """Hand every message to the pipeline; returns the seconds it took."""
    one_by_one = all(len(messages) == 1 for messages, _ in plan)
    started = time.perf_counter()
    if one_by_one:
        handle_live = pipeline.handle_live
        for messages, stream in plan:
            handle_live(messages[0], stream)
    else:
        handle_frames = pipeline.handle_frames
        for messages, stream in plan:
            handle_frames(messages, stream)
    return time.perf_counter() - started


@contextmanager
def collected() -> Iterator[None]:
    """Start from a clean heap; the workload itself is frozen out of the GC's sight."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class LookupProbe:
    """A thread asking ``index`` one lookup per millisecond until stopped; the latencies."""

    PROMPT_BLOCKS = 512

    def __init__(self, index: MemoryIndex, streams: list[StreamId]) -> None:
        rng = random.Random(0)
        self._keys = [rng.getrandbits(64) for _ in range(self.PROMPT_BLOCKS)]
        self._index, self._streams = index, tuple(streams)
        self._stop = threading.Event()
        self.latencies_s: list[float] = []
        self._thread = threading.Thread(target=self._run, name="bench-lookups", daemon=True)

    def __enter__(self) -> LookupProbe:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        holders, keys, streams = self._index.holders, self._keys, self._streams
        while not self._stop.wait(0.001):
            started = time.perf_counter()
            holders(keys, streams)
            self.latencies_s.append(time.perf_counter() - started)


def lookup_summary(latencies_s: list[float]) -> dict[str, Any]:
    """The fields ``--lookup-wait`` adds to a line."""
    ms = sorted(1000 * t for t in latencies_s) or [0.0]
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    return {
        "lookups": len(latencies_s),
        "lookup_p50_ms": round(statistics.median(ms), 3),
        "lookup_p99_ms": round(p99, 3),
        "lookup_max_ms": round(ms[-1], 3),
    }


@contextmanager
def probed(index: MemoryIndex, workload: Workload, on: bool) -> Iterator[LookupProbe | None]:
    """A :class:`LookupProbe` over every stream of ``workload`` while the block runs (or
    nothing, when not ``on``)."""
    if not on:
        yield None
        return
    with LookupProbe(index, [StreamId(t.replica, 0) for t in workload.traces]) as probe:
        yield probe


# --- checks ---------------------------------------------------------------------------------


def check(index: BlockIndex, registry: Registry, workload: Workload) -> dict[str, Any]:
    """Index vs simulator: blocks per stream, every batch applied, nothing unexpected."""
    entries, mismatched = 0, []
    for trace in workload.traces:
        held = index.stats(StreamId(trace.replica, 0)).num_blocks
        entries += held
        if held != trace.num_resident_blocks:
            mismatched.append(trace.replica)
            log.warning("%s: index holds %d blocks, the simulated cache %d",
                        trace.replica, held, trace.num_resident_blocks)  # fmt: skip
    counters = fleet_totals(registry).counters
    applied = counters.num_batches
    if applied != len(workload.frames):
        log.warning("%d of %d batches were applied", applied, len(workload.frames))
    return {
        "entries": entries,
        "consistent": not mismatched and applied == len(workload.frames),
        "orphan_stores": counters.num_orphan_stores,
        "unknown_removals": counters.num_unknown_removals,
        "gaps": counters.num_gaps,
    }


def result(backend: str, workload: Workload, seconds: float, **extra: Any) -> dict[str, Any]:
    blocks = workload.num_blocks_stored + workload.num_blocks_removed
    batches = len(workload.frames)
    return {
        "bench": "ingest",
        "backend": backend,
        "encoding": workload.config.encoding,
        "replicas": workload.config.replicas,
        "blocks": blocks,
        "blocks_stored": workload.num_blocks_stored,
        "blocks_removed": workload.num_blocks_removed,
        "events": workload.num_events,
        "batches": batches,
        "seconds": round(seconds, 3),
        "blocks_per_s": round(blocks / seconds),
        "stored_blocks_per_s": round(workload.num_blocks_stored / seconds),
        "events_per_s": round(workload.num_events / seconds),
        "batches_per_s": round(batches / seconds),
        "us_per_batch": round(1e6 * seconds / batches, 2),
        **extra,
    }


# --- backends -------------------------------------------------------------------------------


def new_memory_index(backend: str) -> BlockIndex:
    """``memory``, ``memory-python`` (the tables' Python oracle) or ``memory-dump`` (with the
    journal ``api.dynamo_dump`` keeps, the compiled ingest path off)."""
    if backend == "memory-python":
        return python_index()
    if backend == "memory-dump":
        return JournaledIndex(MemoryIndex(), BlockJournal())
    return MemoryIndex()


def memory_index_bytes(workload: Workload, plan: list[Delivery], backend: str) -> int:
    """Bytes a memory index filled by ``plan`` holds: what dropping it frees (traced)."""
    tracemalloc.start()
    try:
        index = new_memory_index(backend)
        pipeline, registry = new_pipeline(index, workload)
        drive(pipeline, plan)
        del pipeline, registry
        gc.collect()
        filled = tracemalloc.get_traced_memory()[0]
        del index
        gc.collect()
        return filled - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


def run_memory(
    workload: Workload,
    plan: list[Delivery],
    repeat: int,
    *,
    backend: str = "memory",
    lookup_wait: bool = False,
) -> dict[str, Any]:
    """``repeat`` runs on fresh indexes; the median time is reported, the last one checked,
    then one more (not timed) measures the index's bytes. ``python``: on the pure-Python
    tables. ``lookup_wait``: the lookups of a :class:`LookupProbe` timed meanwhile (all
    runs' together)."""
    times: list[float] = []
    checked: dict[str, Any] = {}
    compiled = backend != "memory-python"
    latencies: list[float] = []
    for i in range(repeat):
        index = new_memory_index(backend)
        pipeline, registry = new_pipeline(index, workload)
        with collected(), probed(index, workload, lookup_wait) as probe:  # type: ignore[arg-type]
            times.append(drive(pipeline, plan))
        if probe is not None:
            latencies += probe.latencies_s
        log.info("%s run %d/%d: %.2fs", backend, i + 1, repeat, times[-1])
        if i == repeat - 1:
            checked = check(index, registry, workload)
        del index, pipeline, registry
    seconds = statistics.median(times)
    num_bytes = memory_index_bytes(workload, plan, backend)
    per_entry = num_bytes / max(checked["entries"], 1)
    log.info("%s index: %.1f MB, %.1f bytes per entry", backend, num_bytes / 1e6, per_entry)
    waits = lookup_summary(latencies) if lookup_wait else {}
    return result(
        backend, workload, seconds, repeat=repeat, seconds_all=[round(t, 3) for t in times],
        **checked, bytes_per_entry=round(per_entry, 1), index_bytes=num_bytes, compiled=compiled,
        **waits,
    )  # fmt: skip


def used_memory(client: RedisClient) -> int:
    info: dict[str, Any] = client.info("memory")
    return int(info["used_memory"])


def server_time(client: RedisClient, num_batches: int) -> dict[str, Any]:
    """Redis's own account (INFO commandstats): calls per command, server µs per batch."""
    stats: dict[str, dict[str, Any]] = client.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in stats.items()}
    micros = sum(int(s["usec"]) for name, s in stats.items() if name != "cmdstat_info")
    return {
        "server_us_per_batch": round(micros / num_batches, 2),
        "server_calls": {k: v for k, v in sorted(calls.items()) if k != "info"},
    }


def run_redis(
    workload: Workload, plan: list[Delivery], url: str, *, private: bool, keep: bool
) -> dict[str, Any]:
    """One run against Redis: a private server is flushed first, a shared one gets a fresh
    key prefix (and its keys are deleted afterwards unless ``keep``)."""
    client = connect(url)
    if private:
        client.flushall()
    prefix = "kvbench" if private else f"kvbench-{os.getpid()}-{int(time.time())}"
    index = RedisIndex(client, Schema(prefix))
    pipeline, registry = new_pipeline(index, workload)
    before = used_memory(client)
    client.config_resetstat()
    with collected():
        seconds = drive(pipeline, plan)
    log.info("redis run: %.2fs", seconds)
    server = server_time(client, len(workload.frames))
    time.sleep(_SETTLE_S)
    after = used_memory(client)
    checked = check(index, registry, workload)
    version = str(client.info("server")["redis_version"])
    if not private and not keep:
        for stream in index.streams():
            index.drop(stream)
    index.close()
    per_entry = (after - before) / max(checked["entries"], 1)
    return result(
        "redis", workload, seconds, repeat=1, **checked, bytes_per_entry=round(per_entry, 1),
        used_memory_before=before, used_memory_after=after, redis_version=version, **server,
    )  # fmt: skip


# --- sharded indexers ----------------------------------------------------------------------


def member_ids(num_indexers: int) -> list[str]:
    return [f"bench-{i}" for i in range(num_indexers)]


def shard_plan(plan: list[Delivery], num_indexers: int) -> list[list[Delivery]]:
    """Each indexer's share of the deliveries: the streams it owns by the rendezvous hash
    (every delivery holds one replica's messages; the first names it by its topic only)."""
    members = member_ids(num_indexers)
    shares: list[list[Delivery]] = [[] for _ in members]
    owner_of: dict[str, int] = {}
    for delivery in plan:
        messages, stream = delivery
        replica = stream.replica if stream else Topic.parse(messages[0][0].decode()).replica
        assert replica is not None
        if replica not in owner_of:
            owner = rendezvous_owner(str(StreamId(replica, 0)), members)
            owner_of[replica] = members.index(owner or members[0])
        shares[owner_of[replica]].append(delivery)
    return shares


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True, slots=True)
class _Job:
    """What one sharded indexer process runs."""

    url: str
    prefix: str
    member: str
    workload: Workload
    share: list[Delivery]


def _indexer_process(job: _Job, start: Any, out: Any) -> None:
    """One sharded indexer: its own connection, a fenced index (the streams it owns are
    claimed as its pipeline first meets them), its share of the frames."""
    index = RedisIndex(connect(job.url), Schema(job.prefix), owner=f"{job.member}#bench")
    workload, share = job.workload, job.share
    specs = tuple(ReplicaSpec(id=t.replica, model=MODEL) for t in workload.traces)
    settings = IndexerSettings(replicas=specs, key_cache_size=_key_cache_size(index))
    registry = Registry(settings.replicas)
    pipeline = Pipeline(settings, index, registry, claim=index.claim)
    start.wait()
    cpu = _cpu_s()
    with collected():
        drive(pipeline, share)
    ended, cpu = time.monotonic(), _cpu_s() - cpu
    counters = fleet_totals(registry).counters
    out.put((ended, cpu, counters.num_batches, pipeline.num_fenced_batches))
    index.close()


def redis_cpu_s(client: RedisClient) -> float:
    """The server's CPU seconds (every master's, summed, on a cluster)."""
    if isinstance(client, RedisCluster):
        per_node: dict[str, dict[str, Any]] = client.info("cpu", target_nodes=client.PRIMARIES)
        infos = list(per_node.values())
    else:
        infos = [client.info("cpu")]
    return sum(float(i["used_cpu_user"]) + float(i["used_cpu_sys"]) for i in infos)


def run_sharded(
    workload: Workload, plan: list[Delivery], url: str, num_indexers: int
) -> dict[str, Any]:
    """``num_indexers`` forked indexer processes on one (private, flushed) Redis."""
    client = connect(url)
    if isinstance(client, RedisCluster):
        client.flushall(target_nodes=client.PRIMARIES)
    else:
        client.flushall()
    prefix = "kvbench"
    shares = shard_plan(plan, num_indexers)
    context = multiprocessing.get_context("fork")
    start, out = context.Event(), context.Queue()
    workers = [
        context.Process(
            target=_indexer_process,
            args=(_Job(url, prefix, member, workload, share), start, out),
        )
        for member, share in zip(member_ids(num_indexers), shares, strict=True)
    ]
    for worker in workers:
        worker.start()
    time.sleep(0.5)  # every process connected and waiting
    redis_before = redis_cpu_s(client)
    started = time.monotonic()
    start.set()
    reports = [out.get() for _ in workers]
    for worker in workers:
        worker.join()
    seconds = max(r[0] for r in reports) - started
    redis_cpu = redis_cpu_s(client) - redis_before
    index = RedisIndex(client, Schema(prefix))
    entries, consistent = _check_entries(index, workload)
    num_applied = sum(r[2] for r in reports)
    cpu = [round(r[1], 2) for r in reports]
    log.info("redis, %d indexers: %.2fs (CPU per indexer %s s, redis %.2f s)",
             num_indexers, seconds, cpu, redis_cpu)  # fmt: skip
    index.close()
    return result(
        "redis", workload, seconds, repeat=1, indexers=num_indexers, entries=entries,
        consistent=consistent and num_applied == len(workload.frames),
        calls_per_indexer=[len(s) for s in shares], fenced_batches=sum(r[3] for r in reports),
        cpu_s_per_indexer=cpu, redis_cpu_s=round(redis_cpu, 2),
        cluster=isinstance(client, RedisCluster),
        cores_busy=round((sum(r[1] for r in reports) + redis_cpu) / seconds, 2),
        cpu_count=os.cpu_count(),
    )  # fmt: skip


# --- over ZeroMQ, with ingest workers -------------------------------------------------------

_ZMQ_TIMEOUT_S = 300.0
"""Longest a ZeroMQ run may take before it is reported as inconsistent."""


def _publisher_process(workload: Workload, endpoints: Any, go: Any, sent: Any, done: Any) -> None:
    """One PUB per replica on loopback (unbounded send queue, so nothing is dropped): their
    endpoints out, then on ``go`` every frame in arrival order, ``sent``, held open until
    ``done``."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub_of: dict[bytes, zmq.Socket[bytes]] = {}
    out: dict[str, str] = {}
    for trace in workload.traces:
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind("tcp://127.0.0.1:0")
        pub_of[topic(trace.replica)] = pub
        out[trace.replica] = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    endpoints.put(out)
    go.wait()
    for frame in workload.frames:
        pub_of[frame[0]].send_multipart(frame)
    sent.set()
    done.wait()
    for pub in pub_of.values():
        pub.close()
    context.term()


def _zmq_run(
    workload: Workload, num_workers: int, lookup_wait: bool = False
) -> tuple[float, float, dict[str, Any], list[float]]:
    """One run: (seconds, CPU seconds of this process, the checks, the lookups' latencies
    when ``lookup_wait``)."""
    context = multiprocessing.get_context("fork")
    endpoints_q, go, sent, done = context.Queue(), context.Event(), context.Event(), context.Event()
    publisher = context.Process(
        target=_publisher_process, args=(workload, endpoints_q, go, sent, done)
    )
    publisher.start()
    try:
        endpoints: dict[str, str] = endpoints_q.get(timeout=60)
        specs = tuple(
            ReplicaSpec(id=t.replica, model=MODEL, events=endpoints[t.replica])
            for t in workload.traces
        )
        settings = IndexerSettings(replicas=specs, ingest_workers=num_workers)
        index, registry = MemoryIndex(), Registry(specs)
        subscriber = Subscriber(settings, index, registry)
        subscriber.open()  # connected, not read: the frames queue until the workers start
        time.sleep(0.5)  # every SUB connected and subscribed
        go.set()
        if not sent.wait(_ZMQ_TIMEOUT_S):
            raise RuntimeError("the publisher did not send its frames in time")
        with collected(), probed(index, workload, lookup_wait) as probe:
            seconds, cpu = _drain_timed(subscriber, registry, len(workload.frames))
        checked = check(index, registry, workload)
        subscriber.stop()
    finally:
        done.set()
        publisher.join(10)
    return seconds, cpu, checked, [] if probe is None else probe.latencies_s


def _drain_timed(
    subscriber: Subscriber, registry: Registry, num_batches: int
) -> tuple[float, float]:
    """Start the workers; the seconds and CPU until every batch is applied (or the timeout)."""
    cpu, started = _cpu_s(), time.monotonic()
    subscriber.start()
    deadline = started + _ZMQ_TIMEOUT_S
    while fleet_totals(registry).counters.num_batches < num_batches:
        if time.monotonic() > deadline:
            break
        time.sleep(0.005)
    return time.monotonic() - started, _cpu_s() - cpu


def run_workers(
    workload: Workload, counts: tuple[int, ...], repeat: int, *, lookup_wait: bool = False
) -> list[dict[str, Any]]:
    """``repeat`` rounds of one run per worker count (alternated); medians reported."""
    times: dict[int, list[float]] = {n: [] for n in counts}
    cpus: dict[int, list[float]] = {n: [] for n in counts}
    waits: dict[int, list[float]] = {n: [] for n in counts}
    checked: dict[int, dict[str, Any]] = {}
    for i in range(repeat):
        for n in counts:
            seconds, cpu, checks, latencies = _zmq_run(workload, n, lookup_wait)
            waits[n] += latencies
            times[n].append(seconds)
            cpus[n].append(cpu)
            consistent = checked.get(n, checks)["consistent"] and checks["consistent"]
            checked[n] = {**checks, "consistent": consistent}
            log.info("memory over ZeroMQ, %d workers, run %d/%d: %.2fs, CPU %.2fs",
                     n, i + 1, repeat, seconds, cpu)  # fmt: skip
    lines = []
    first = statistics.median(times[counts[0]])
    for n in counts:
        seconds, cpu = statistics.median(times[n]), statistics.median(cpus[n])
        extra: dict[str, Any] = {"speedup": round(first / seconds, 2)} if n != counts[0] else {}
        if lookup_wait:
            extra.update(lookup_summary(waits[n]))
        lines.append(result(
            "memory-zmq", workload, seconds, workers=n, repeat=repeat,
            seconds_all=[round(t, 3) for t in times[n]], cpu_s=round(cpu, 2),
            cores_busy=round(cpu / seconds, 2), cpu_count=len(os.sched_getaffinity(0)),
            **checked[n], **extra,
        ))  # fmt: skip
    return lines


def _check_entries(index: BlockIndex, workload: Workload) -> tuple[int, bool]:
    """Resident entries, and whether every stream holds what its simulated cache does."""
    held = [index.stats(StreamId(t.replica, 0)).num_blocks for t in workload.traces]
    same = all(h == t.num_resident_blocks for h, t in zip(held, workload.traces, strict=True))
    return sum(held), same


def run_backends(args: BenchArgs, workload: Workload) -> list[dict[str, Any]]:
    plan = deliveries(workload, args.drain)
    results: list[dict[str, Any]] = []
    if "memory" in args.backends:
        results.append(run_memory(workload, plan, args.repeat, lookup_wait=args.lookup_wait))
    if "memory-python" in args.backends:
        results.append(run_memory(workload, plan, args.repeat, backend="memory-python"))
    if "memory-dump" in args.backends:
        results.append(run_memory(workload, plan, args.repeat, backend="memory-dump"))
    if "redis" in args.backends:
        if args.redis_url is not None:
            url, private = args.redis_url, False
            results.append(run_redis(workload, plan, url, private=private, keep=args.keep))
        elif not args.indexers:
            with private_redis() as url:
                log.info("private redis-server at %s", url)
                results.append(run_redis(workload, plan, url, private=True, keep=False))
        else:
            servers = private_cluster() if args.cluster else private_redis()
            with servers as url:
                log.info("private redis %s at %s", "cluster" if args.cluster else "server", url)
                results += [run_sharded(workload, plan, url, n) for n in args.indexers]
    for line in results:
        line["drain"] = args.drain
        line["calls"] = len(plan)
    if args.workers:
        results += run_workers(workload, args.workers, args.repeat, lookup_wait=args.lookup_wait)
    return results


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    logging.getLogger("kvindex.subscriber").setLevel(logging.WARNING)
    args = parse_args(argv)
    workload = coalesced(generate(args), args.coalesce)
    machine = {"calibration_ms": calibration_ms()}
    ok = True
    for line in run_backends(args, workload):
        line["quick"] = args.quick
        line["coalesce"] = args.coalesce
        line.update(machine)
        print(json.dumps(line), flush=True)
        ok = ok and bool(line["consistent"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
