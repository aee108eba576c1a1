"""Routers for ``kvindex simulate``: :class:`ScorerRouter`, ``POST /score``'s code over an index
fed ``event_delay_s`` late (:class:`IngestSink`, :class:`ZmqSink`), and :class:`InstantRouter`
(``kv_aware_instant``), which reads every pool directly: greedy, so not a bound."""

from __future__ import annotations

import collections
import random
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvindex.api.config.settings import ApiSettings, ModelSpec
from kvindex.api.decision.policies import (
    Candidate,
    LoadInput,
    Policy,
    ScoringError,
    Weights,
    kv_aware,
    rank,
)
from kvindex.api.load.model import Load
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.schemas import ScoreRequest
from kvindex.api.score import Scorer
from kvindex.clients.fake_vllm.block_pool import BlockPool
from kvindex.clients.fake_vllm.publisher import EventPublisher
from kvindex.clients.simulate.fleet import FleetSettings, Job, ReplicaLoad, SimulationError
from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.domain.events import Event, StreamId, Tier
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.fleet.registry import Freshness, Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.ingest.pipeline import Pipeline
from kvindex.indexer.ingest.wire import encode_batch, encode_live
from kvindex.indexer.service import IndexerService

INSTANT = "kv_aware_instant"
INDEX_POLICIES = frozenset({Policy.KV_AWARE})
"""Policies whose decision reads the index (the others run without one)."""


@dataclass(frozen=True, slots=True)
class PolicySpec:
    label: str
    """As given (``kv_aware:waiting=0.5``); names the policy in every output."""
    policy: str
    """A :class:`~kvindex.api.decision.policies.Policy` value, or :data:`INSTANT`."""
    weights: dict[str, float] = field(default_factory=dict)


def parse_policy(text: str) -> PolicySpec:
    """``name`` or ``name:weight=value,weight=value``; raises :class:`SimulationError`."""
    name, _, rest = text.strip().partition(":")
    known = [p.value for p in Policy] + [INSTANT]
    if name == "oracle":
        raise SimulationError(
            f"'oracle' is not a policy: every report ends with the oracle, the bound no policy"
            f" beats; kv_aware with perfect knowledge is {INSTANT!r}"
        )
    if name not in known:
        raise SimulationError(f"policy {name!r} is not one of {known}")
    overrides: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        try:
            overrides[key.strip()] = float(value)
        except ValueError:
            raise SimulationError(f"{text!r}: {item!r} is not weight=number") from None
        if not eq:
            raise SimulationError(f"{text!r}: {item!r} is not weight=number")
    try:
        Weights().overridden(overrides)
    except ScoringError as exc:
        raise SimulationError(f"{text!r}: {exc}") from exc
    return PolicySpec(text.strip(), name, overrides)


class SimClock:
    """The simulation's 'now'."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# --- event sinks ---------------------------------------------------------------------------


class EventSink(Protocol):
    registry: Registry
    index: MemoryIndex

    def emitted(self, replica: str, events: list[Event], now: float) -> None: ...

    def deliver(self, now: float) -> None:
        """Make the index hold every batch emitted at or before ``now - event delay``."""
        ...

    def close(self) -> None: ...


def _specs(fleet: FleetSettings) -> tuple[ReplicaSpec, ...]:
    return tuple(ReplicaSpec(rid, fleet.model) for rid in fleet.replica_ids())


class _Delayed:
    """Batches in emission order, each due ``delay_s`` after it was emitted."""

    def __init__(self, delay_s: float) -> None:
        self._delay_s = delay_s
        self._queue: collections.deque[tuple[float, str, list[Event]]] = collections.deque()

    def push(self, replica: str, events: list[Event], now: float) -> None:
        self._queue.append((now, replica, events))

    def due(self, now: float) -> Iterator[tuple[float, str, list[Event]]]:
        """(emitted at, replica, events) of every batch due at ``now``, oldest first."""
        queue = self._queue
        while queue and queue[0][0] + self._delay_s <= now:
            yield queue.popleft()


class IngestSink:
    """Events encoded as a vLLM publisher would, handed to the indexer's
    :class:`~kvindex.indexer.ingest.pipeline.Pipeline` as its socket loop would."""

    def __init__(
        self, fleet: FleetSettings, clock: SimClock, *, event_delay_s: float, stale_after_s: float
    ) -> None:
        self._delayed = _Delayed(event_delay_s)
        self.index = MemoryIndex()
        settings = IndexerSettings(replicas=_specs(fleet), stale_after_s=stale_after_s)
        self.registry = Registry(settings.replicas, stale_after_s=stale_after_s, clock=clock)
        self._pipeline = Pipeline(settings, self.index, self.registry, clock=clock)
        self._topics = {r: f"kv@{r}@{fleet.model}".encode() for r in fleet.replica_ids()}
        self._seq: dict[str, int] = {}
        for rid in fleet.replica_ids():
            self.registry.record(StreamId(rid), StreamReport(connected=True))

    def emitted(self, replica: str, events: list[Event], now: float) -> None:
        self._delayed.push(replica, events, now)

    def deliver(self, now: float) -> None:
        for emitted_at, replica, events in self._delayed.due(now):
            seq = self._seq[replica] = self._seq.get(replica, -1) + 1
            payload = encode_batch(events, ts=emitted_at, rank=0, encoding="map")
            frames = encode_live(self._topics[replica], seq, payload)
            self._pipeline.handle_live(frames, StreamId(replica))

    def close(self) -> None:
        self.index.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ZmqSink:
    """Events sent in vLLM's wire format over ZeroMQ (loopback) to a real indexer."""

    def __init__(self, fleet: FleetSettings, *, event_delay_s: float, stale_after_s: float) -> None:
        self._delayed = _Delayed(event_delay_s)
        bind = f"tcp://127.0.0.1:{_free_port()}"
        settings = IndexerSettings(replicas=_specs(fleet), bind=bind, stale_after_s=stale_after_s)
        self.index = MemoryIndex()
        self._service = IndexerService.build(settings, self.index)
        self.registry = self._service.registry
        self._service.start()
        self._publishers: dict[str, EventPublisher] = {}
        self._sent: dict[str, int] = {}
        try:
            for rid in fleet.replica_ids():
                topic = f"kv@{rid}@{fleet.model}"
                self._publishers[rid] = EventPublisher(bind, topic=topic, bind=False)
            self._warm_up()
        except BaseException:
            self.close()
            raise

    def _warm_up(self) -> None:
        """Publish an empty batch per replica until the indexer sees each (slow joiner)."""
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            for rid, publisher in self._publishers.items():
                if self._applied(rid) < 0:
                    self._sent[rid] = publisher.publish([], ts=0.0)
            if all(self._applied(rid) >= 0 for rid in self._publishers):
                return
            time.sleep(0.05)
        raise SimulationError("the indexer did not hear the simulated replicas within 10 s")

    def _applied(self, replica: str) -> int:
        status = self.registry.status(StreamId(replica))
        return -1 if status is None else status.health.last_seq

    def emitted(self, replica: str, events: list[Event], now: float) -> None:
        self._delayed.push(replica, events, now)

    def deliver(self, now: float) -> None:
        touched: set[str] = set()
        for emitted_at, replica, events in self._delayed.due(now):
            self._sent[replica] = self._publishers[replica].publish(events, ts=emitted_at)
            touched.add(replica)
        deadline = time.monotonic() + 30.0
        while any(self._applied(r) < self._sent[r] for r in touched):
            if time.monotonic() > deadline:
                raise SimulationError("the indexer fell behind by more than 30 s")
            time.sleep(0.0005)

    def close(self) -> None:
        for publisher in self._publishers.values():
            publisher.close()
        self._service.stop()


# --- routers ------------------------------------------------------------------------------


class ScorerRouter:
    """Routes through :class:`kvindex.api.score.Scorer` (``POST /score`` as a library call)."""

    def __init__(
        self,
        spec: PolicySpec,
        fleet: FleetSettings,
        *,
        sink: EventSink | None,
        clock: SimClock,
        seed: int,
        load_interval_s: float = 0.0,
    ) -> None:
        """``load_interval_s``: replicas' load is read this often (0: at every request)."""
        self._spec = spec
        self._model = fleet.model
        self._clock = clock
        self._sink = sink
        self._load_interval_s = load_interval_s
        self._next_load_s = 0.0
        registry = sink.registry if sink else Registry(_specs(fleet), clock=clock)
        index = sink.index if sink else MemoryIndex()
        settings = ApiSettings(
            default_policy=spec.policy,
            models=(ModelSpec(fleet.model, block_size=fleet.block_size),),
            seed=seed,
        )
        self._loads = MemoryLoadStore()
        self._scorer = Scorer(
            settings,
            index,
            registry,
            self._loads,
            tokenizers=lambda _model: None,
            blocking_store=False,
            clock=clock,
        )

    async def route(self, job: Job, now: float, loads: Sequence[ReplicaLoad]) -> str:
        self._clock.now = now
        if self._sink is not None:
            self._sink.deliver(now)
        if now >= self._next_load_s:
            self._report(loads, now)
        request = ScoreRequest(
            model=self._model,
            token_ids=job.tokens,
            session=job.request.session,
            weights=self._spec.weights or None,
        )
        answer = await self._scorer.score(request)
        return answer.best if answer.best is not None else loads[0].replica

    def _report(self, loads: Sequence[ReplicaLoad], now: float) -> None:
        for load in loads:
            self._loads.put(
                load.replica, Load(load.running, load.waiting, load.kv_usage, now, "push")
            )
        self._next_load_s = now + self._load_interval_s

    def emitted(self, replica: str, events: list[Event], now: float) -> None:
        if self._sink is not None:
            self._sink.emitted(replica, events, now)

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()


class InstantRouter:
    """``kv_aware`` with instant, perfect knowledge of every replica's cache."""

    def __init__(self, spec: PolicySpec, *, seed: int) -> None:
        self._weights = Weights().overridden(spec.weights)
        self._cache_of: Callable[[str], BlockPool] | None = None
        self._rng = random.Random(seed)

    def watch(self, cache_of: Callable[[str], BlockPool]) -> None:
        self._cache_of = cache_of

    async def route(self, job: Job, now: float, loads: Sequence[ReplicaLoad]) -> str:
        cands = [self._candidate(job.chain, load) for load in loads]
        decision = rank(
            kv_aware(cands, len(job.chain), self._weights), cands, self._weights, self._rng
        )
        return decision.best if decision.best is not None else loads[0].replica

    def _candidate(self, chain: Sequence[int], load: ReplicaLoad) -> Candidate:
        if self._cache_of is None:
            raise SimulationError("InstantRouter.watch() was not called")
        cache = self._cache_of(load.replica)
        matched = 0
        for block in chain:
            if not cache.is_cached(block):
                break
            matched += 1
        return Candidate(
            load.replica,
            (Tier.GPU,) * matched,
            Freshness.LIVE,
            LoadInput(load.running, load.waiting, load.kv_usage, 0.0),
        )

    def emitted(self, replica: str, events: list[Event], now: float) -> None:
        pass  # it reads the pools themselves

    def close(self) -> None:
        pass
