"""A fleet of simulated vLLM replicas, and the KV-event frames they publish.

Each replica is a small model of vLLM's v1 scheduler and prefix-cache block pool
(``vllm/v1/core/sched/scheduler.py``, ``vllm/v1/core/block_pool.py``):

* a pool of ``capacity_blocks`` blocks of 16 tokens; every block is either held by a
  running request or in the free queue, which hands out the least recently freed block
  first. A handed-out block that still holds a hash is evicted: one ``BlockRemoved`` with
  that single hash, as vLLM publishes it.
* requests are turns of chat conversations: a system prompt shared fleet-wide (a handful of
  them, tens of blocks each), the conversation's history, a new user message, then the
  generated output. At admission the longest cached prefix is reused (no store event for
  it); the rest is computed by chunked prefill under a per-step token budget, then decoded
  one token per step. Every block that becomes full is cached: one ``BlockStored`` per
  request per step, chained to the parent block's hash (often stored many batches ago).
* finished requests free their blocks tail first (vLLM frees in reverse order, so a
  sequence's last blocks are evicted before its prefix).
* one scheduler step that produced events is one batch ``[ts, events, 0]``, encoded as
  vLLM 0.33 (events are maps) or 0.23 (events are arrays) sends it, field for field as in
  the captured vectors (``tests/fixtures``), ``extra_keys`` and ``kv_cache_spec_kind``
  included.

Engine block hashes are XXH3-64 chains over (parent hash, token ids) with a per-replica
seed: deterministic, uniform over u64 (half of them ≥ 2**63) and different on every
replica, as with vLLM's hash algorithms when the replicas' seeds differ.

Everything is generated before any timing starts; generation is deterministic per seed.
"""

from __future__ import annotations

import heapq
import random
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import msgspec
import xxhash

from kvindex.indexer.events import StreamId
from kvindex.indexer.wire import Encoding

BLOCK_SIZE = 16
VOCAB_SIZE = 128_256
"""Llama 3's vocabulary: about half of the token ids need a 5-byte msgpack integer."""
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
MAX_CONTEXT_TOKENS = 6_144
"""A conversation ends once its history is this long."""

_TOKEN_BYTES = 4
_BLOCK_BYTES = BLOCK_SIZE * _TOKEN_BYTES
_ROOT_HASH = 0
_SYSTEM_PROMPT_BLOCKS = (20, 60)
_USER_TOKENS = (32, 768)
_OUTPUT_TOKENS = (32, 512)
_TURNS = (1, 8)
_P_CONTINUE = 0.7
"""Chance that the next request is another turn of an idle conversation."""
_BLOCKS_PER_IDLE_CONVERSATION = 256
_STEP_BASE_S = 0.008
_STEP_PER_TOKEN_S = 2e-5
_encoder = msgspec.msgpack.Encoder()


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
    """Distinct system prompts shared by every replica's conversations."""
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


# --- engine hashes and tokens -------------------------------------------------------------


def chain_hashes(seed: int, parent: int | None, tokens: Sequence[int], first: int) -> list[int]:
    """Engine hashes of the full blocks of ``tokens`` from block ``first`` on."""
    end = len(tokens) // BLOCK_SIZE
    data = array("I", tokens[first * BLOCK_SIZE : end * BLOCK_SIZE]).tobytes()
    current = _ROOT_HASH if parent is None else parent
    hashes: list[int] = []
    for i in range(end - first):
        chunk = data[i * _BLOCK_BYTES : (i + 1) * _BLOCK_BYTES]
        current = xxhash.xxh3_64_intdigest(current.to_bytes(8, "big") + chunk, seed)
        hashes.append(current)
    return hashes


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [t % VOCAB_SIZE for t in array("I", rng.randbytes(count * _TOKEN_BYTES))]


def _ceil_blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


# --- vLLM's wire events ---------------------------------------------------------------------
# Mirrors of vLLM's own structs (vllm/distributed/kv_events.py), so that payloads are
# byte-identical to what vLLM sends (msgspec writes a struct map with a 16-bit header).


class _MapEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """vLLM 0.24+ ``KVCacheEvent``: a map tagged by ``type`` (0.33 fields)."""


class _StoredMap(_MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _RemovedMap(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _ArrayEvent(msgspec.Struct, array_like=True, tag=True, omit_defaults=True, gc=False):
    """vLLM ≤ 0.23 ``KVCacheEvent``: an array, tag first, every field present (0.23)."""


class _StoredArray(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _RemovedArray(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


WireEvent = _StoredMap | _RemovedMap | _StoredArray | _RemovedArray


@dataclass(frozen=True, slots=True)
class EventEncoder:
    """vLLM's events for the GPU prefix cache of a plain (non-hybrid) model."""

    encoding: Encoding

    def stored(self, hashes: list[int], parent: int | None, tokens: list[int]) -> WireEvent:
        cls = _StoredArray if self.encoding == "array" else _StoredMap
        extra_keys: list[tuple[Any, ...] | None] = [None] * len(hashes)
        return cls(
            hashes, parent, tokens, BLOCK_SIZE, None, "GPU", None, extra_keys, 0, "full_attention"
        )

    def removed(self, block_hash: int) -> WireEvent:
        cls = _RemovedArray if self.encoding == "array" else _RemovedMap
        return cls([block_hash], "GPU", 0)


def encode_payload(ts: float, events: list[WireEvent]) -> bytes:
    """One batch ``[ts, events, data_parallel_rank]``."""
    return _encoder.encode([ts, events, 0])


# --- the block pool -------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Block:
    block_id: int
    block_hash: int | None = None
    ref_cnt: int = 0


class BlockPool:
    """vLLM's prefix-cache block pool for one KV-cache group.

    Not thread-safe. ``events`` lists passed in receive the ``BlockRemoved`` of evictions.
    """

    def __init__(self, capacity: int, encoder: EventEncoder) -> None:
        self._free: OrderedDict[int, _Block] = OrderedDict((i, _Block(i)) for i in range(capacity))
        self._hash_to_blocks: dict[int, list[_Block]] = {}
        self._encoder = encoder
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_resident(self) -> int:
        """Distinct hashes cached: what the index must hold for this replica."""
        return len(self._hash_to_blocks)

    def touch_prefix(self, hashes: Sequence[int], limit: int) -> list[_Block]:
        """Take the longest cached prefix (at most ``limit`` blocks) for a new request."""
        hit: list[_Block] = []
        for block_hash in hashes[:limit]:
            blocks = self._hash_to_blocks.get(block_hash)
            if blocks is None:
                break
            block = blocks[0]
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1
            hit.append(block)
        return hit

    def allocate(self, count: int, events: list[WireEvent]) -> list[_Block]:
        """Hand out ``count`` free blocks, least recently freed first, evicting their hashes."""
        blocks: list[_Block] = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block, events)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: _Block, events: list[WireEvent]) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        holders = self._hash_to_blocks[block_hash]
        holders.remove(block)
        if not holders:
            del self._hash_to_blocks[block_hash]
        block.block_hash = None
        self.num_evicted += 1
        events.append(self._encoder.removed(block_hash))

    def cache(self, blocks: Sequence[_Block], hashes: Sequence[int]) -> None:
        """Newly full blocks become reusable (a hash computed twice is cached twice)."""
        for block, block_hash in zip(blocks, hashes, strict=True):
            block.block_hash = block_hash
            self._hash_to_blocks.setdefault(block_hash, []).append(block)

    def free(self, blocks: Sequence[_Block]) -> None:
        """Release a finished request's blocks, tail first (evicted before its prefix)."""
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block


# --- requests and the scheduler ---------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Conversation:
    tokens: list[int]
    hashes: list[int]
    """Engine hashes of the full blocks of ``tokens``."""
    turns_left: int


@dataclass(slots=True, eq=False)
class _Request:
    conversation: _Conversation
    tokens: list[int]
    """Prompt then output: the output is drawn up front, decoding reveals it."""
    num_prompt_tokens: int
    hashes: list[int]
    blocks: list[_Block] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0
    """Leading blocks already cached (their store was published, or they were hits)."""

    @property
    def num_blocks_needed(self) -> int:
        return _ceil_blocks(len(self.tokens))

    @property
    def finished(self) -> bool:
        return self.num_computed >= len(self.tokens)


class ReplicaSim:
    """One vLLM replica under saturating chat load; :meth:`run` returns what it published."""

    def __init__(self, index: int, config: WorkloadConfig, prompts: list[list[int]]) -> None:
        self.replica = replica_id(index)
        self._config = config
        self._rng = random.Random(config.seed * 1_000_003 + index + 1)
        self._seed = self._rng.getrandbits(64)
        self._encoder = EventEncoder(config.encoding)
        self._pool = BlockPool(config.capacity_blocks, self._encoder)
        self._prompts = [(p, chain_hashes(self._seed, None, p, 0)) for p in prompts]
        self._prompt_weights = [1.0 / (i + 1) for i in range(len(prompts))]
        self._max_idle = max(8, config.capacity_blocks // _BLOCKS_PER_IDLE_CONVERSATION)
        self._running: list[_Request] = []
        self._num_finished = 0
        self._waiting: _Request | None = None
        self._idle: list[_Conversation] = []
        self._trace = ReplicaTrace(self.replica, [], 0)

    def run(self, start_ts: float) -> ReplicaTrace:
        """Step until ``capacity * (1 + turnover)`` blocks were stored."""
        target = self._config.capacity_blocks * (1.0 + self._config.turnover)
        trace = self._trace
        ts = start_ts + self._rng.random() * _STEP_BASE_S
        while trace.num_blocks_stored < target:
            events, num_tokens = self._step()
            ts += _STEP_BASE_S + _STEP_PER_TOKEN_S * num_tokens
            if events:
                trace.payloads.append((ts, encode_payload(ts, events)))
                trace.num_events += len(events)
        trace.num_resident_blocks = self._pool.num_resident
        trace.num_blocks_removed = self._pool.num_evicted
        return trace

    def _step(self) -> tuple[list[WireEvent], int]:
        """One scheduler step: running requests first, then admissions, then retirements."""
        events: list[WireEvent] = []
        budget = self._config.max_batched_tokens
        for request in self._running:
            computed = request.num_computed + 1
            # Fast path: a decode step that neither fills, starts nor ends a block.
            if (
                request.num_computed >= request.num_prompt_tokens
                and computed % BLOCK_SIZE > 1
                and computed < len(request.tokens)
                and budget > 0
            ):
                request.num_computed = computed
                budget -= 1
                continue
            budget -= self._advance(request, budget, events)
        while budget > 0 and len(self._running) < self._config.max_running:
            admitted = self._admit()
            if admitted is None:
                break
            budget -= self._advance(admitted, budget, events)
        if not self._running:
            raise RuntimeError("a request needs more blocks than the whole cache holds")
        if self._num_finished:
            self._retire()
        return events, self._config.max_batched_tokens - budget

    def _advance(self, request: _Request, budget: int, events: list[WireEvent]) -> int:
        """Compute the request's next tokens (a prefill chunk or one decode token)."""
        left = request.num_prompt_tokens - request.num_computed
        count = min(left if left > 0 else 1, budget, len(request.tokens) - request.num_computed)
        if count <= 0:
            return 0
        missing = _ceil_blocks(request.num_computed + count) - len(request.blocks)
        if missing > 0:
            request.blocks += self._pool.allocate(missing, events)
        request.num_computed += count
        self._cache_full_blocks(request, events)
        if request.finished:
            self._num_finished += 1
        return count

    def _cache_full_blocks(self, request: _Request, events: list[WireEvent]) -> None:
        first, end = request.num_cached, request.num_computed // BLOCK_SIZE
        if end <= first:
            return
        hashes = request.hashes[first:end]
        self._pool.cache(request.blocks[first:end], hashes)
        parent = request.hashes[first - 1] if first else None
        tokens = request.tokens[first * BLOCK_SIZE : end * BLOCK_SIZE]
        events.append(self._encoder.stored(hashes, parent, tokens))
        request.num_cached = end
        self._trace.num_blocks_stored += len(hashes)

    def _admit(self) -> _Request | None:
        """Admit the waiting request if the pool can hold all of it; reuse its cached prefix."""
        if self._waiting is None:
            self._waiting = self._new_request()
        request = self._waiting
        if request.num_blocks_needed > self._pool.num_free - self._reserved():
            return None
        self._waiting = None
        num_prompt_blocks = (request.num_prompt_tokens - 1) // BLOCK_SIZE
        request.blocks = self._pool.touch_prefix(request.hashes, num_prompt_blocks)
        request.num_cached = len(request.blocks)
        request.num_computed = request.num_cached * BLOCK_SIZE
        self._trace.num_prompt_blocks += num_prompt_blocks
        self._trace.num_prompt_blocks_hit += request.num_cached
        self._running.append(request)
        return request

    def _reserved(self) -> int:
        return sum(r.num_blocks_needed - len(r.blocks) for r in self._running)

    def _retire(self) -> None:
        for request in [r for r in self._running if r.finished]:
            self._pool.free(request.blocks)
            self._end_turn(request)
        self._running = [r for r in self._running if not r.finished]
        self._num_finished = 0

    def _end_turn(self, request: _Request) -> None:
        conversation = request.conversation
        conversation.tokens = request.tokens
        conversation.hashes = request.hashes
        conversation.turns_left -= 1
        if conversation.turns_left > 0 and len(request.tokens) < MAX_CONTEXT_TOKENS:
            self._idle.append(conversation)

    def _new_request(self) -> _Request:
        conversation = self._pick_conversation()
        rng = self._rng
        user = random_tokens(rng, rng.randint(*_USER_TOKENS))
        output = random_tokens(rng, rng.randint(*_OUTPUT_TOKENS))
        tokens = conversation.tokens + user + output
        known = conversation.hashes
        parent = known[-1] if known else None
        hashes = known + chain_hashes(self._seed, parent, tokens, len(known))
        return _Request(conversation, tokens, len(conversation.tokens) + len(user), hashes)

    def _pick_conversation(self) -> _Conversation:
        idle, rng = self._idle, self._rng
        if idle and (len(idle) >= self._max_idle or rng.random() < _P_CONTINUE):
            i = rng.randrange(len(idle))
            idle[i], idle[-1] = idle[-1], idle[i]
            return idle.pop()
        tokens, hashes = rng.choices(self._prompts, self._prompt_weights)[0]
        return _Conversation(list(tokens), list(hashes), rng.randint(*_TURNS))


# --- the fleet ------------------------------------------------------------------------------


def system_prompts(config: WorkloadConfig) -> list[list[int]]:
    """The fleet's system prompts: tens of blocks each, not block-aligned."""
    rng = random.Random(config.seed)
    low, high = _SYSTEM_PROMPT_BLOCKS
    return [
        random_tokens(rng, rng.randint(low, high) * BLOCK_SIZE + rng.randrange(BLOCK_SIZE))
        for _ in range(config.num_system_prompts)
    ]


def simulate_replica(index: int, config: WorkloadConfig, start_ts: float) -> ReplicaTrace:
    return ReplicaSim(index, config, system_prompts(config)).run(start_ts)


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
        frames.append([topic(replica), seq.to_bytes(8, "big"), payload])
        streams.append(StreamId(replica, 0) if replica in registered else None)
        registered.add(replica)
    return Workload(config, frames, streams, traces)


def _numbered(trace: ReplicaTrace) -> Iterator[tuple[float, str, int, bytes]]:
    for seq, (ts, payload) in enumerate(trace.payloads):
        yield ts, trace.replica, seq, payload
