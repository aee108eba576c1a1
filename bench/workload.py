"""The ingest benchmark's workload: a fleet of simulated vLLM replicas and the frames they publish.

Each replica is a :class:`~kvindex.clients.fake_vllm.scheduler.StepScheduler` (vLLM's v1
scheduler, stepped offline: chunked prefill under a token budget, decode, LRU eviction)
over a :class:`~kvindex.clients.fake_vllm.block_pool.BlockPool` of ``capacity_blocks``
blocks of 16 tokens, serving :class:`~kvindex.clients.workloads.chats.ChatSessions` (turns of
chats behind a few system prompts shared fleet-wide). One scheduler step that produced
events is one batch ``[ts, events, 0]``, encoded by :func:`kvindex.indexer.ingest.wire.encode_batch`
as vLLM 0.33 (events are maps) or 0.23 (events are arrays) sends it, field for field.

Each replica has its own engine-hash root
(:func:`~kvindex.clients.fake_vllm.engine_hash.engine_root` of a per-replica seed), so the
same tokens hash differently on every replica, as with vLLM's hash algorithms when the
replicas' seeds differ.

Everything is generated before any timing starts; generation is deterministic per seed.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from itertools import repeat

from kvindex.clients.fake_vllm.block_pool import BlockPool
from kvindex.clients.fake_vllm.engine_hash import engine_root
from kvindex.clients.fake_vllm.scheduler import STEP_BASE_S, StepScheduler
from kvindex.clients.workloads.chats import ChatSessions, chat_system_prompts
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.ingest.wire import Encoding, encode_batch, encode_live

BLOCK_SIZE = 16
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
_BLOCKS_PER_IDLE_CHAT = 256


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Shape of the simulated fleet. Every field is defaulted."""

    replicas: int = 16
    """Number of replicas (one stream each, data-parallel rank 0)."""
    capacity_blocks: int = 68_750
    """Prefix-cache blocks per replica (16 tokens each)."""
    turnover: float = 1.0
    """Blocks stored per replica beyond filling its cache, as a multiple of the capacity."""
    encoding: Encoding = "map"
    """``map``: vLLM 0.24+ events (0.33 captured); ``array``: vLLM 0.23 and earlier."""
    max_running: int = 32
    """vLLM ``max_num_seqs``: requests scheduled at once per replica."""
    max_batched_tokens: int = 8_192
    """vLLM ``max_num_batched_tokens``: tokens per scheduler step (chunked prefill)."""
    num_system_prompts: int = 6
    """Distinct system prompts shared by every replica's chats."""
    seed: int = 0
    """Everything generated is a function of this seed."""


@dataclass(slots=True)
class ReplicaTrace:
    """What one replica published, and what its prefix cache holds at the end."""

    replica: str
    payloads: list[tuple[float, bytes]]
    num_resident_blocks: int
    num_blocks_stored: int = 0
    num_blocks_removed: int = 0
    num_events: int = 0
    num_prompt_blocks: int = 0
    num_prompt_blocks_hit: int = 0


@dataclass(slots=True)
class Workload:
    """Frames of every replica, interleaved by engine timestamp, ready to be replayed.

    ``streams[i]`` is what to pass with ``frames[i]`` to ``Subscriber.handle_live``: None
    for a replica's first frame (the stream registers itself from its topic) and the
    replica's :class:`StreamId` afterwards.
    """

    config: WorkloadConfig
    frames: list[list[bytes]]
    streams: list[StreamId | None]
    traces: list[ReplicaTrace]

    @property
    def num_blocks_stored(self) -> int:
        return sum(t.num_blocks_stored for t in self.traces)

    @property
    def num_blocks_removed(self) -> int:
        return sum(t.num_blocks_removed for t in self.traces)

    @property
    def num_events(self) -> int:
        return sum(t.num_events for t in self.traces)

    @property
    def num_payload_bytes(self) -> int:
        return sum(len(frame[2]) for frame in self.frames)

    @property
    def prefix_hit_rate(self) -> float:
        prompt = sum(t.num_prompt_blocks for t in self.traces)
        return sum(t.num_prompt_blocks_hit for t in self.traces) / max(prompt, 1)


def replica_id(index: int) -> str:
    return f"r{index:03d}"


def topic(replica: str) -> bytes:
    """llm-d's topic convention, which the subscriber parses in bind mode."""
    return f"kv@{replica}@{MODEL}".encode()


def simulate_replica(index: int, config: WorkloadConfig, start_ts: float) -> ReplicaTrace:
    """Step replica ``index`` until ``capacity * (1 + turnover)`` blocks were stored."""
    rng = random.Random(config.seed * 1_000_003 + index + 1)
    pool = BlockPool(config.capacity_blocks, BLOCK_SIZE, engine_root(rng.getrandbits(64)))
    prompts = chat_system_prompts(config.seed, config.num_system_prompts, BLOCK_SIZE)
    max_idle = max(8, config.capacity_blocks // _BLOCKS_PER_IDLE_CHAT)
    scheduler = StepScheduler(
        pool,
        ChatSessions(rng, prompts, max_idle=max_idle),
        max_running=config.max_running,
        max_batched_tokens=config.max_batched_tokens,
    )
    trace = ReplicaTrace(replica_id(index), [], 0)
    target = config.capacity_blocks * (1.0 + config.turnover)
    batches = scheduler.batches(start_ts + rng.random() * STEP_BASE_S)  # replicas out of step
    while scheduler.num_blocks_stored < target:
        ts, events = next(batches)
        payload = encode_batch(events, ts=ts, rank=0, encoding=config.encoding)
        trace.payloads.append((ts, payload))
        trace.num_events += len(events)
    trace.num_blocks_stored = scheduler.num_blocks_stored
    trace.num_prompt_blocks = scheduler.num_prompt_blocks
    trace.num_prompt_blocks_hit = scheduler.num_prompt_blocks_hit
    trace.num_resident_blocks = pool.num_cached_blocks
    trace.num_blocks_removed = pool.num_evicted
    return trace


def build_workload(config: WorkloadConfig, start_ts: float, *, jobs: int = 1) -> Workload:
    """Simulate every replica (in ``jobs`` processes), then interleave their frames by ts."""
    indexes = range(config.replicas)
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            traces = list(pool.map(simulate_replica, indexes, repeat(config), repeat(start_ts)))
    else:
        traces = [simulate_replica(i, config, start_ts) for i in indexes]
    frames: list[list[bytes]] = []
    streams: list[StreamId | None] = []
    registered: set[str] = set()
    for _, replica, seq, payload in heapq.merge(*(_numbered(t) for t in traces)):
        frames.append(encode_live(topic(replica), seq, payload))
        streams.append(StreamId(replica, 0) if replica in registered else None)
        registered.add(replica)
    return Workload(config, frames, streams, traces)


def _numbered(trace: ReplicaTrace) -> Iterator[tuple[float, str, int, bytes]]:
    for seq, (ts, payload) in enumerate(trace.payloads):
        yield ts, trace.replica, seq, payload
