"""The discrete-event core of ``kvindex simulate``: N replicas, their caches, their queues.

A replica admits its FIFO head when its prefill is free, fewer than ``max_running`` run and
its block pool holds the request; prefills run one after another, decodes together. Nothing
sleeps: a run is a pure function of its inputs and the router."""

from __future__ import annotations

import collections
import heapq
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvindex.clients.fake_vllm.block_pool import BlockPool
from kvindex.clients.fake_vllm.engine_hash import engine_chain, engine_root
from kvindex.clients.workloads.trace import TraceRequest
from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.events import Event


class SimulationError(KvIndexError):
    """Invalid simulation settings, or a router that picked no known replica."""


@dataclass(frozen=True, slots=True)
class FleetSettings:
    replicas: int = 8
    capacity_blocks: int = 16_384
    """KV-cache blocks per replica."""
    block_size: int = 16
    prefill_tps: float = 12_000.0
    """Prompt tokens per second one replica computes (prefills run one after another)."""
    decode_tps: float = 40.0
    """Output tokens per second of one request (decodes run together)."""
    max_running: int = 64
    """Requests admitted at once per replica."""
    model: str = "sim-model"

    def __post_init__(self) -> None:
        for name in ("replicas", "capacity_blocks", "block_size", "max_running"):
            if getattr(self, name) < 1:
                raise SimulationError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prefill_tps", "decode_tps"):
            if not getattr(self, name) > 0:
                raise SimulationError(f"{name} must be > 0, got {getattr(self, name)}")

    def replica_ids(self) -> list[str]:
        return [f"r{i}" for i in range(self.replicas)]


@dataclass(slots=True)
class Job:
    index: int
    request: TraceRequest
    tokens: list[int]
    chain: list[int]
    """Engine block hashes of the prompt's full blocks."""
    replica: str = ""
    admitted_s: float = 0.0
    hit_tokens: int = 0
    first_token_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request's result (a rejected one has ``replica`` set and ``rejected`` True)."""

    index: int
    replica: str
    arrival_s: float
    input_tokens: int
    hit_tokens: int
    ttft_s: float
    queue_s: float
    rejected: bool = False
    output_tokens: int = 0
    finish_s: float = 0.0
    """When its last token came (0 for a rejected request)."""

    @property
    def admitted_s(self) -> float:
        return self.arrival_s + self.queue_s

    @property
    def prefill_s(self) -> float:
        return self.ttft_s - self.queue_s


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    replica: str
    running: int
    waiting: int
    kv_usage: float


class Router(Protocol):
    """Picks a replica for each request; sees every event the replicas emit."""

    async def route(self, job: Job, now: float, loads: Sequence[ReplicaLoad]) -> str: ...

    def emitted(self, replica: str, events: list[Event], now: float) -> None: ...


@dataclass
class _Replica:
    id: str
    cache: BlockPool
    waiting: collections.deque[Job] = field(default_factory=collections.deque)
    running: int = 0
    prefill_free_s: float = 0.0


@dataclass
class FleetResult:
    outcomes: list[Outcome]
    queue_samples: list[int]
    """Waiting requests of every replica, sampled at every arrival."""
    requests_per_replica: dict[str, int]
    kv_usage_samples: list[float] = field(default_factory=list)
    """Every replica's share of blocks held by running requests, sampled with the queue."""


class Prompts:
    """Each request's prompt tokens and block hashes, made once for every policy of a run."""

    def __init__(self, requests: Sequence[TraceRequest], settings: FleetSettings) -> None:
        self.requests = requests
        self.block_size = settings.block_size
        self.root = engine_root(settings.model)
        self._packed: dict[int, tuple[array[int], array[int]]] = {}

    def get(self, index: int) -> tuple[list[int], list[int]]:
        """(prompt tokens, engine hashes of its full blocks)."""
        packed = self._packed.get(index)
        if packed is not None:
            return packed[0].tolist(), packed[1].tolist()
        tokens = self.requests[index].tokens()
        chain = engine_chain(self.root, tokens, self.block_size)
        try:
            packed_tokens = array("H", tokens)
        except OverflowError:
            packed_tokens = array("I", tokens)
        self._packed[index] = (packed_tokens, array("Q", chain))
        return tokens, chain


# Kinds, in the order they run at one instant: freed room is visible to arrivals.
_FINISH, _PREFILL_DONE, _ARRIVE = 0, 1, 2


class FleetSim:
    """One run of ``requests`` through ``settings.replicas`` fresh replicas and ``router``."""

    def __init__(
        self,
        settings: FleetSettings,
        router: Router,
        requests: Sequence[TraceRequest],
        *,
        prompts: Prompts | None = None,
        publish: bool = True,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.settings = settings
        self._router = router
        self._requests = requests
        self._prompts = prompts if prompts is not None else Prompts(requests, settings)
        self._progress = progress
        self._root = self._prompts.root
        self._replicas = {rid: _Replica(rid, self._pool(publish)) for rid in settings.replica_ids()}
        self._heap: list[tuple[float, int, int, Job | str | int]] = []
        self._order = 0
        self._outcomes: list[Outcome] = []
        self._samples: list[int] = []
        self._usage: list[float] = []
        self._per_replica = dict.fromkeys(self._replicas, 0)
        self.now = 0.0

    def _pool(self, publish: bool) -> BlockPool:
        settings = self.settings
        return BlockPool(settings.capacity_blocks, settings.block_size, self._root, publish=publish)

    def cache(self, replica: str) -> BlockPool:
        return self._replicas[replica].cache

    async def run(self) -> FleetResult:
        for i, request in enumerate(self._requests):
            self._push(request.arrival_s, _ARRIVE, i)
        while self._heap:
            t, kind, _, item = heapq.heappop(self._heap)
            self.now = t
            if kind == _ARRIVE:
                assert isinstance(item, int)
                await self._arrive(item)
            elif kind == _PREFILL_DONE:
                assert isinstance(item, str)
                self._admit(self._replicas[item])
            else:
                assert isinstance(item, Job)
                self._finish(item)
        self._outcomes.sort(key=lambda o: o.index)
        return FleetResult(self._outcomes, self._samples, self._per_replica, self._usage)

    def loads(self) -> list[ReplicaLoad]:
        return [
            ReplicaLoad(r.id, r.running, len(r.waiting), r.cache.usage)
            for r in self._replicas.values()
        ]

    # --- arrival and admission -----------------------------------------------------------

    async def _arrive(self, index: int) -> None:
        request = self._requests[index]
        tokens, chain = self._prompts.get(index)
        job = Job(index, request, tokens, chain)
        self._samples.extend(len(r.waiting) for r in self._replicas.values())
        self._usage.extend(r.cache.usage for r in self._replicas.values())
        replica_id = await self._router.route(job, self.now, self.loads())
        replica = self._replicas.get(replica_id)
        if replica is None:
            raise SimulationError(f"router picked unknown replica {replica_id!r}")
        job.replica = replica_id
        self._per_replica[replica_id] += 1
        if not self._fits(job):
            self._outcomes.append(
                Outcome(index, replica_id, request.arrival_s, len(tokens), 0, 0.0, 0.0, True)
            )
            self._done_one()
            return
        replica.waiting.append(job)
        self._admit(replica)

    def _fits(self, job: Job) -> bool:
        total = len(job.tokens) + job.request.output_length
        return bool(job.tokens) and -(-total // self.settings.block_size) <= (
            self.settings.capacity_blocks
        )

    def _admit(self, replica: _Replica) -> None:
        settings = self.settings
        if not replica.waiting or replica.running >= settings.max_running:
            return
        if replica.prefill_free_s > self.now:
            return
        job = replica.waiting[0]
        total = len(job.tokens) + job.request.output_length
        admission = replica.cache.admit(job.index, job.tokens, total, chain=job.chain)
        if admission is None:
            return
        replica.waiting.popleft()
        replica.running += 1
        self._emit(replica, admission.events)
        job.admitted_s = self.now
        job.hit_tokens = admission.num_hit_blocks * settings.block_size
        prefill_s = (len(job.tokens) - job.hit_tokens) / settings.prefill_tps
        job.first_token_s = replica.prefill_free_s = self.now + prefill_s
        self._push(job.first_token_s, _PREFILL_DONE, replica.id)
        finish = job.first_token_s + job.request.output_length / settings.decode_tps
        self._push(finish, _FINISH, job)

    # --- completion ----------------------------------------------------------------------

    def _finish(self, job: Job) -> None:
        replica = self._replicas[job.replica]
        answer = job.request.output
        if answer is not None:
            full = job.tokens + list(answer)
            chain = engine_chain(self._root, full, self.settings.block_size)
            self._emit(replica, replica.cache.cache_full_blocks(job.index, full, chain))
        replica.cache.release(job.index)
        replica.running -= 1
        arrival = job.request.arrival_s
        self._outcomes.append(
            Outcome(
                job.index,
                job.replica,
                arrival,
                len(job.tokens),
                job.hit_tokens,
                job.first_token_s - arrival,
                job.admitted_s - arrival,
                output_tokens=job.request.output_length,
                finish_s=self.now,
            )
        )
        self._done_one()
        self._admit(replica)

    def _emit(self, replica: _Replica, events: list[Event]) -> None:
        if events:
            self._router.emitted(replica.id, events, self.now)

    def _push(self, t: float, kind: int, item: Job | str | int) -> None:
        self._order += 1
        heapq.heappush(self._heap, (t, kind, self._order, item))

    def _done_one(self) -> None:
        if self._progress is not None:
            self._progress(1)
