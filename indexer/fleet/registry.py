"""The replicas kvindex knows, and the health record of each of their streams.

Replicas come from the settings (config file, command line), from run-time calls
(:meth:`Registry.add` / :meth:`Registry.remove`, exposed over HTTP by the API) and, in
bind mode, from the topic ``kv@<replica>@<model>`` of their first event. The write path
(the pipeline thread) changes a stream's :class:`~kvindex.indexer.domain.health.StreamHealth`
only through :meth:`Registry.record`; any thread may read a consistent snapshot.
:func:`fleet_totals` adds up the fleet for ``GET /stats``, ``/metrics`` and the CLI.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.domain.health import (
    StreamCounters,
    StreamHealth,
    StreamReport,
    UnroutedCounters,
)
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.fleet.replica_health import HEALTHY, ReplicaHealth
from kvindex.indexer.index.protocol import BlockIndex


class Freshness(enum.Enum):
    """How far a stream's index entries can be trusted right now."""

    LIVE = "live"
    REPLAYING = "replaying"
    STALE = "stale"


@dataclass(frozen=True, slots=True)
class StreamStatus:
    """One stream as of a moment: its record (a copy), and what it means then."""

    stream: StreamId
    freshness: Freshness
    silent_s: float | None
    """Seconds since anything was heard from the stream."""
    health: StreamHealth
    owner: str | None = None
    """The sharded indexer that keeps the stream (None: one indexer, or in-process)."""


class StreamFreshness(NamedTuple):
    """The part of a stream's status a scorer needs (cheap: no record copied)."""

    stream: StreamId
    freshness: Freshness
    lag_s: float | None
    silent_s: float | None
    connected: bool = True
    """Its socket is connected (connect mode); bind-mode streams read False."""
    disconnected_s: float | None = None
    """Seconds since the socket monitor said it disconnected (None: connected, or never
    connected)."""


HealthChange = Callable[[ReplicaHealth], ReplicaHealth]
"""A pure change of a replica's health record (``ReplicaHealth.after_check`` and co.)."""
HealthUpdate = tuple[ReplicaHealth, ReplicaHealth]
"""A record before and after a change."""


class Registry:
    """Thread-safe map of replica id → spec, plus one health record per stream and one
    :class:`~kvindex.indexer.fleet.replica_health.ReplicaHealth` per replica."""

    def __init__(
        self,
        replicas: tuple[ReplicaSpec, ...] = (),
        *,
        stale_after_s: float = 300.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._lock = threading.Lock()
        self._replicas: dict[str, ReplicaSpec] = {r.id: r for r in replicas}
        self._health: dict[StreamId, StreamHealth] = {}
        self._disconnected: set[StreamId] = set()
        """The streams whose record says not connected, kept as records change (the API
        asks per request: no pass over every record)."""
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._version = 0
        self._streams_version = 0
        """Bumped whenever a spec or the set of stream records changes."""
        self._unrouted = UnroutedCounters()
        self._replica_health: dict[str, ReplicaHealth] = {}
        self._sorted: tuple[ReplicaSpec, ...] | None = None
        """``replicas()`` as of the last change (None: to be sorted again)."""
        self._model_to_block_size: dict[str, int | None] = {}
        """``block_size()`` per model, until a spec, a stream or a stream's size changes."""

    # --- replicas ------------------------------------------------------------------------

    def add(self, spec: ReplicaSpec) -> bool:
        """Register or update a replica; False if an identical spec was already there."""
        with self._lock:
            if self._replicas.get(spec.id) == spec:
                return False
            self._replicas[spec.id] = spec
            self._version += 1
            self._streams_version += 1
            self._sorted = None
            self._model_to_block_size.clear()
            return True

    def remove(self, replica: str) -> ReplicaSpec | None:
        """Forget a replica and its streams' records; returns the removed spec."""
        with self._lock:
            spec = self._replicas.pop(replica, None)
            for stream in [s for s in self._health if s.replica == replica]:
                del self._health[stream]
                self._disconnected.discard(stream)
            self._replica_health.pop(replica, None)
            self._streams_version += 1
            if spec is not None:
                self._version += 1
                self._sorted = None
            self._model_to_block_size.clear()
            return spec

    def get(self, replica: str) -> ReplicaSpec | None:
        with self._lock:
            return self._replicas.get(replica)

    def replicas(self) -> list[ReplicaSpec]:
        """Every spec, by id (sorted once per change: the API reads it per request)."""
        with self._lock:
            if self._sorted is None:
                self._sorted = tuple(sorted(self._replicas.values(), key=lambda r: r.id))
            return list(self._sorted)

    @property
    def version(self) -> int:
        """Bumped on every add/remove, so the subscriber knows to reconcile its sockets."""
        with self._lock:
            return self._version

    def streams_version(self) -> int:
        """Changes whenever :meth:`replicas` or :meth:`stream_ids` may have (one int read:
        the API asks per request, to keep what it made of them meanwhile)."""
        return self._streams_version

    def models(self) -> list[str]:
        with self._lock:
            return sorted({r.model for r in self._replicas.values()})

    # --- replica health (written by health checks and breakers) ------------------------

    def replica_health(self) -> dict[str, ReplicaHealth]:
        """The record of every registered replica judged so far (one absent is healthy)."""
        with self._lock:
            return dict(self._replica_health)

    def update_health(self, changes: dict[str, HealthChange]) -> dict[str, HealthUpdate]:
        """Apply each change to its replica's record atomically; returns (before, after)
        per registered replica (changes of unknown replicas are dropped)."""
        out: dict[str, HealthUpdate] = {}
        with self._lock:
            for replica, change in changes.items():
                if replica not in self._replicas:
                    continue
                before = self._replica_health.get(replica, HEALTHY)
                after = self._replica_health[replica] = change(before)
                out[replica] = (before, after)
        return out

    def claim_health_checks(self, replicas: Sequence[str], hold_s: float) -> set[str]:
        """Every one: a process alone on its registry checks every replica."""
        return set(replicas)

    # --- stream health (written by the pipeline) -----------------------------------------

    def record(self, stream: StreamId, report: StreamReport) -> None:
        """Fold a report into the stream's record (creating it), as of the registry's clock.

        Reports of one stream must come from one thread, in order; the report is read, not
        kept, so the caller may reuse it afterwards.
        """
        now = self._clock()
        with self._lock:
            health = self._health.get(stream)
            if health is None:
                health = self._health[stream] = StreamHealth()
                self._streams_version += 1
            block_size = health.block_size
            health.update(report, now)
            if health.connected:
                self._disconnected.discard(stream)
            else:
                self._disconnected.add(stream)
            if health.block_size != block_size:
                self._model_to_block_size.clear()

    def forget(self, stream: StreamId) -> None:
        """Drop one stream's record (another indexer keeps the stream now)."""
        with self._lock:
            if self._health.pop(stream, None) is not None:
                self._disconnected.discard(stream)
                self._model_to_block_size.clear()
                self._streams_version += 1

    def record_unrouted(self, totals: UnroutedCounters) -> None:
        """Replace the bound SUB's unrouted counters with the write path's running totals."""
        with self._lock:
            self._unrouted = replace(totals)

    # --- reading -------------------------------------------------------------------------

    def unrouted(self) -> UnroutedCounters:
        """A copy of the bound SUB's counters of frames that reached no stream."""
        with self._lock:
            return replace(self._unrouted)

    def status(self, stream: StreamId) -> StreamStatus | None:
        with self._lock:
            health = self._health.get(stream)
            return None if health is None else self._snapshot(stream, health)

    def stream_ids(self) -> list[StreamId]:
        """The streams with a record (cheap: no snapshot)."""
        with self._lock:
            return list(self._health)

    def freshness(self, streams: Collection[StreamId] | None = None) -> list[StreamFreshness]:
        """Freshness, lag and silence of every stream, in record order, read in one go; of
        ``streams`` only when given (those with a record, in the order given: the API asks
        for the few it explains)."""
        now = self._clock()
        with self._lock:
            items: Iterable[tuple[StreamId, StreamHealth]] = self._health.items()
            if streams is not None:
                health_of = self._health.get
                items = [(s, h) for s in streams if (h := health_of(s)) is not None]
            views = []
            for stream, health in items:
                silent = None if health.last_heard is None else now - health.last_heard
                fresh = freshness_of(health, silent, self._stale_after_s)
                views.append(stream_freshness(stream, health, fresh, silent, now))
            return views

    def disconnected(self) -> list[StreamId]:
        """The streams whose socket is not connected, sorted (every bind-mode stream reads
        so: see :attr:`StreamFreshness.connected`); kept as records change, so it costs
        the streams down, not the fleet."""
        with self._lock:
            return sorted(self._disconnected)

    def statuses(self) -> list[StreamStatus]:
        with self._lock:
            return [self._snapshot(s, health) for s, health in sorted(self._health.items())]

    def _snapshot(self, stream: StreamId, health: StreamHealth) -> StreamStatus:
        return snapshot(
            stream, replace(health), now=self._clock(), stale_after_s=self._stale_after_s
        )

    def records(self) -> dict[StreamId, StreamHealth]:
        """A copy of every stream's record (for publishing them to other processes)."""
        with self._lock:
            return {s: replace(health) for s, health in self._health.items()}

    def block_size(self, model: str) -> int | None:
        """The block size the model's replicas publish (the most common one), if seen;
        remembered until it may change (the API asks per request)."""
        with self._lock:
            known = self._model_to_block_size
            if model in known:
                return known[model]
            replicas = {r.id for r in self._replicas.values() if r.model == model}
            sizes = [
                health.block_size
                for stream, health in self._health.items()
                if stream.replica in replicas and health.block_size
            ]
            size = known[model] = most_common(sizes)
            return size

    def outage(self) -> None:
        """Never: an in-process registry is always current."""
        return None

    def disconnected_for(self, stream: StreamId) -> float | None:
        """Seconds a connect-mode stream has been disconnected (None if connected/unknown)."""
        with self._lock:
            health = self._health.get(stream)
            if health is None or health.connected or health.disconnected_at is None:
                return None
            return self._clock() - health.disconnected_at


def freshness_of(health: StreamHealth, silent_s: float | None, stale_after_s: float) -> Freshness:
    """The freshness rule, shared by the in-process registry and the Redis fleet view.

    Replaying while a replay is open. Otherwise stale when silent for more than
    ``stale_after_s``, when disconnected (since the socket monitor said so), or when
    neither connected nor ever heard from (a connect-mode stream whose endpoint is dead or
    not up yet: what the index holds for it, e.g. from before an indexer restart, cannot be
    vouched for). Else live: connected, or heard from recently (bind-mode streams have no
    connection state; their first batch is what makes them known).
    """
    if health.replaying:
        return Freshness.REPLAYING
    if silent_s is not None and silent_s > stale_after_s:
        return Freshness.STALE
    if not health.connected and (health.disconnected_at is not None or silent_s is None):
        return Freshness.STALE
    return Freshness.LIVE


def stream_freshness(
    stream: StreamId,
    health: StreamHealth,
    freshness: Freshness,
    silent_s: float | None,
    now: float,
) -> StreamFreshness:
    """The scorer's view of one stream's record as of ``now``."""
    gone = health.disconnected_at
    disconnected_s = None if health.connected or gone is None else max(0.0, now - gone)
    return StreamFreshness(
        stream, freshness, health.lag_s, silent_s, health.connected, disconnected_s
    )


def snapshot(
    stream: StreamId,
    health: StreamHealth,
    *,
    now: float,
    stale_after_s: float,
    freshness: Freshness | None = None,
    owner: str | None = None,
) -> StreamStatus:
    """A stream's status as of ``now``, holding ``health`` itself (pass a copy of a record
    that changes); ``freshness`` overrides the computed one."""
    silent = None if health.last_heard is None else max(0.0, now - health.last_heard)
    fresh = freshness or freshness_of(health, silent, stale_after_s)
    return StreamStatus(stream, fresh, silent, health, owner)


def most_common(sizes: list[int]) -> int | None:
    return max(set(sizes), key=sizes.count) if sizes else None


@dataclass(frozen=True, slots=True)
class FleetTotals:
    """The fleet added up (:func:`fleet_totals`)."""

    num_replicas: int
    num_streams: int
    num_streams_by_freshness: dict[Freshness, int]
    """Every freshness, 0 when no stream has it."""
    blocks_by_tier: dict[Tier, int]
    """Blocks the index holds on each tier, over every stream (empty: index not read)."""
    counters: StreamCounters
    """Every stream's counters, added."""
    unrouted: UnroutedCounters = field(default_factory=UnroutedCounters)
    """Frames of the bound SUB that reached no stream."""


def fleet_totals(
    registry: RegistryView,
    index: BlockIndex | None = None,
    *,
    statuses: Sequence[StreamStatus] | None = None,
) -> FleetTotals:
    """Totals over the streams of ``registry``: ``statuses`` when the caller has read them
    already (so its rows and its totals agree), else a fresh read.

    With an ``index``, also the blocks it holds (one ``stats`` call per stream; an
    ``IndexUnavailableError`` propagates).
    """
    if statuses is None:
        statuses = registry.statuses()
    by_freshness = dict.fromkeys(Freshness, 0)
    counters = StreamCounters()
    for status in statuses:
        by_freshness[status.freshness] += 1
        counters.add(status.health)
    blocks: dict[Tier, int] = {}
    if index is not None:
        blocks = dict.fromkeys(Tier, 0)
        for status in statuses:
            for tier, count in index.stats(status.stream).blocks_by_tier.items():
                blocks[tier] += count
    num_replicas = len(registry.replicas())
    unrouted = registry.unrouted()
    return FleetTotals(num_replicas, len(statuses), by_freshness, blocks, counters, unrouted)


class RegistryView(Protocol):
    """What the API reads and changes of the fleet: the in-process :class:`Registry`, or
    ``kvindex.indexer.fleet.view.RedisFleetView`` in an API process that shares Redis with an
    indexer.

    Reads may lag the writer by the view's cache period; ``add``/``remove`` are visible to
    the same view at once."""

    def replicas(self) -> list[ReplicaSpec]: ...

    def get(self, replica: str) -> ReplicaSpec | None: ...

    def add(self, spec: ReplicaSpec) -> bool:
        """Register or update a replica; False if an identical spec was already there."""
        ...

    def remove(self, replica: str) -> ReplicaSpec | None:
        """Forget a replica and its streams' state; returns the removed spec."""
        ...

    def models(self) -> list[str]: ...

    def statuses(self) -> list[StreamStatus]: ...

    def freshness(self, streams: Collection[StreamId] | None = None) -> list[StreamFreshness]:
        """Every stream's; ``streams`` only when given (those known, in the order given)."""
        ...

    def disconnected(self) -> list[StreamId]:
        """The streams whose socket is not connected (bind-mode streams included), sorted."""
        ...

    def stream_ids(self) -> list[StreamId]: ...

    def streams_version(self) -> int:
        """A number that changes whenever :meth:`replicas` or :meth:`stream_ids` may have
        (it may change without them): equal numbers, the same specs and streams."""
        ...

    def block_size(self, model: str) -> int | None: ...

    def unrouted(self) -> UnroutedCounters:
        """Frames of the bound SUB that reached no stream (zeros where not known)."""
        ...

    def outage(self) -> str | None:
        """Why the fleet read is the last one known rather than the current one (its store
        cannot be read, or lost it), or None when it is current."""
        ...

    def replica_health(self) -> dict[str, ReplicaHealth]:
        """The health record of every replica judged so far (one absent is healthy)."""
        ...

    def update_health(self, changes: dict[str, HealthChange]) -> dict[str, HealthUpdate]:
        """Apply each change to its replica's current record, atomically (another process
        changing the same record is never lost); (before, after) per replica changed.
        Raises ``IndexUnavailableError`` when the shared store cannot be written."""
        ...

    def claim_health_checks(self, replicas: Sequence[str], hold_s: float) -> set[str]:
        """The replicas this process is to check now: each one no other process sharing
        the fleet claimed in the last ``hold_s`` seconds."""
        ...
