"""The replicas kvindex knows and each stream's health record; the write path changes a record
only through :meth:`Registry.record`, any thread reads a consistent snapshot."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol, runtime_checkable

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
    PARTIAL = "partial"
    """Live, but the replica may hold blocks the index never learnt (``StreamHealth.partial``
    says why and since when): what the index holds is right, some of the rest is missing."""
    REPLAYING = "replaying"
    STALE = "stale"
    ORPHANED = "orphaned"
    """Sharded, and no live indexer keeps it (its owner's lease ran out): until taken over."""


@dataclass(frozen=True, slots=True)
class StreamStatus:
    """One stream as of a moment: its record (a copy), and what it means then."""

    stream: StreamId
    freshness: Freshness
    silent_s: float | None  # seconds since anything was heard from the stream
    health: StreamHealth
    owner: str | None = None  # the sharded indexer that keeps it (None: not sharded)


_LIVE, _PARTIAL = Freshness.LIVE, Freshness.PARTIAL
_REPLAYING, _STALE = Freshness.REPLAYING, Freshness.STALE


class StreamFreshness(NamedTuple):
    """The part of a stream's status a scorer needs (cheap: no record copied)."""

    stream: StreamId
    freshness: Freshness
    lag_s: float | None
    silent_s: float | None
    connected: bool = True  # connect mode's socket; bind-mode streams read False
    disconnected_s: float | None = None
    partial: str | None = None  # why the view is partial (``StreamHealth.partial``)
    partial_since: float | None = None


PriorView = Callable[[StreamId], "tuple[str, float] | None"]
"""The (reason, since) of a stream's view as another process last published it partial."""
HealthChange = Callable[[ReplicaHealth], ReplicaHealth]  # a pure change of a record
HealthUpdate = tuple[ReplicaHealth, ReplicaHealth]  # a record before and after a change


class Registry:
    """Thread-safe: replica id → spec, a health record per stream and one per replica."""

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

        self._stale_after_s = stale_after_s
        self._clock = clock
        self._version = 0
        self._streams_version = 0

        self._unrouted = UnroutedCounters()
        self._replica_health: dict[str, ReplicaHealth] = {}
        self._sorted: tuple[ReplicaSpec, ...] | None = None

        self._model_to_block_size: dict[str, int | None] = {}
        self._prior_view: PriorView | None = None
        self._replica_to_clear_asked: dict[str, float] = {}

    # --- replicas ------------------------------------------------------------------------

    def add(self, spec: ReplicaSpec) -> bool:
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
        return self._streams_version

    def models(self) -> list[str]:
        with self._lock:
            return sorted({r.model for r in self._replicas.values()})

    # --- replica health (written by health checks and breakers) ------------------------

    def replica_health(self) -> dict[str, ReplicaHealth]:
        with self._lock:
            return dict(self._replica_health)

    def update_health(self, changes: dict[str, HealthChange]) -> dict[str, HealthUpdate]:
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
        return set(replicas)

    # --- stream health (written by the pipeline) -----------------------------------------

    def record(self, stream: StreamId, report: StreamReport) -> None:
        """Fold a report into the stream's record; one stream's come from one thread, in order."""
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

    def read_prior_views(self, lookup: PriorView) -> None:
        """Where :meth:`resume_partial` finds what an earlier indexer published (Redis)."""
        self._prior_view = lookup

    def resume_partial(self, stream: StreamId) -> str | None:
        """A stream resumed from a kept index (a restart, a takeover): the reason its view
        was partial when last published, now its record's too (with its since); None: whole."""
        prior = None if self._prior_view is None else self._prior_view(stream)
        if prior is None:
            return None
        reason, since = prior
        with self._lock:
            health = self._health.get(stream)
            if health is None:
                health = self._health[stream] = StreamHealth()
                self._streams_version += 1
            health.partial, health.partial_since = reason, since
        return reason

    def forget(self, stream: StreamId) -> None:
        """Drop one stream's record (another indexer keeps the stream now)."""
        with self._lock:
            if self._health.pop(stream, None) is not None:
                self._disconnected.discard(stream)
                self._model_to_block_size.clear()
                self._streams_version += 1

    def ask_clear(self, replica: str, at: float | None = None) -> None:
        """Have the pipelines of ``replica``'s streams drop their blocks once (next maintenance)."""
        at = self._clock() if at is None else at
        with self._lock:
            if at > self._replica_to_clear_asked.get(replica, float("-inf")):
                self._replica_to_clear_asked[replica] = at

    def clear_asks(self) -> dict[str, float]:
        with self._lock:
            return dict(self._replica_to_clear_asked) if self._replica_to_clear_asked else {}

    def record_unrouted(self, totals: UnroutedCounters) -> None:
        with self._lock:
            self._unrouted = replace(totals)

    # --- reading -------------------------------------------------------------------------

    def unrouted(self) -> UnroutedCounters:
        with self._lock:
            return replace(self._unrouted)

    def status(self, stream: StreamId) -> StreamStatus | None:
        with self._lock:
            health = self._health.get(stream)
            return None if health is None else self._snapshot(stream, health)

    def stream_ids(self) -> list[StreamId]:
        with self._lock:
            return list(self._health)

    def freshness(self, streams: Collection[StreamId] | None = None) -> list[StreamFreshness]:
        """Reference: :func:`freshness_of` and :func:`stream_freshness`, inlined (a call per
        stream was most of a 512-replica answer's reads);
        tests/unit/indexer/fleet/test_registry.py::test_freshness_equals_its_reference"""
        now, after, make = self._clock(), self._stale_after_s, tuple.__new__
        with self._lock:
            items: Iterable[tuple[StreamId, StreamHealth]] = self._health.items()
            if streams is not None:
                health_of = self._health.get
                items = [(s, h) for s in streams if (h := health_of(s)) is not None]
            views: list[StreamFreshness] = []
            for stream, health in items:
                heard, connected, partial = health.last_heard, health.connected, health.partial
                silent = None if heard is None else now - heard
                gone = health.disconnected_at
                if health.replaying:
                    fresh = _REPLAYING
                elif (silent is not None and silent > after) or (
                    not connected and (gone is not None or silent is None)
                ):
                    fresh = _STALE
                else:
                    fresh = _LIVE if partial is None else _PARTIAL
                disconnected_s = None if connected or gone is None else max(0.0, now - gone)
                # tuple.__new__: the NamedTuple's own __new__ is a Python call per stream
                view = (stream, fresh, health.lag_s, silent, connected, disconnected_s, partial,
                        health.partial_since)  # fmt: skip
                views.append(make(StreamFreshness, view))
            return views

    def disconnected(self) -> list[StreamId]:
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
        with self._lock:
            return {s: replace(health) for s, health in self._health.items()}

    def block_size(self, model: str) -> int | None:
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
        return None

    def disconnected_for(self, stream: StreamId) -> float | None:
        """Seconds a connect-mode stream has been disconnected (None if connected/unknown)."""
        with self._lock:
            health = self._health.get(stream)
            if health is None or health.connected or health.disconnected_at is None:
                return None
            return self._clock() - health.disconnected_at


def freshness_of(health: StreamHealth, silent_s: float | None, stale_after_s: float) -> Freshness:
    """Replaying during a replay; else stale if silent past ``stale_after_s``, disconnected,
    or never connected nor heard from; else partial while its view is; else live."""
    if health.replaying:
        return Freshness.REPLAYING
    if silent_s is not None and silent_s > stale_after_s:
        return Freshness.STALE
    if not health.connected and (health.disconnected_at is not None or silent_s is None):
        return Freshness.STALE
    return Freshness.LIVE if health.partial is None else Freshness.PARTIAL


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
        stream,
        freshness,
        health.lag_s,
        silent_s,
        health.connected,
        disconnected_s,
        health.partial,
        health.partial_since,
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
    """A stream's status as of ``now``, holding ``health`` itself (pass a copy)."""
    silent = None if health.last_heard is None else max(0.0, now - health.last_heard)
    fresh = freshness or freshness_of(health, silent, stale_after_s)
    return StreamStatus(stream, fresh, silent, health, owner)


def most_common(sizes: list[int]) -> int | None:
    return max(set(sizes), key=sizes.count) if sizes else None


@dataclass(frozen=True, slots=True)
class FleetTotals:
    num_replicas: int
    num_streams: int
    num_streams_by_freshness: dict[Freshness, int]
    blocks_by_tier: dict[Tier, int]  # empty: the index was not read
    counters: StreamCounters
    unrouted: UnroutedCounters = field(default_factory=UnroutedCounters)


def fleet_totals(
    registry: RegistryView,
    index: BlockIndex | None = None,
    *,
    statuses: Sequence[StreamStatus] | None = None,
) -> FleetTotals:
    """Totals over ``statuses`` (default: a fresh read), with an ``index`` its blocks too."""
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
    """What the API reads and changes of the fleet: the in-process :class:`Registry` or the
    Redis-backed ``RedisFleetView``. Reads may lag by the view's cache period; its own
    ``add``/``remove`` are visible at once."""

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
        """The streams whose socket is not connected (bind-mode ones included), sorted."""
        ...

    def stream_ids(self) -> list[StreamId]: ...

    def streams_version(self) -> int:
        """Changes whenever :meth:`replicas` or :meth:`stream_ids` may have."""
        ...

    def block_size(self, model: str) -> int | None: ...

    def unrouted(self) -> UnroutedCounters:
        """Frames of the bound SUB that reached no stream (zeros where not known)."""
        ...

    def outage(self) -> str | None:
        """Why the fleet read is the last one known, not the current one (None: current)."""
        ...

    def replica_health(self) -> dict[str, ReplicaHealth]:
        """The record of every replica judged so far (one absent is healthy)."""
        ...

    def update_health(self, changes: dict[str, HealthChange]) -> dict[str, HealthUpdate]:
        """Apply each change atomically to its replica's record; (before, after) of each changed."""
        ...

    def claim_health_checks(self, replicas: Sequence[str], hold_s: float) -> set[str]:
        """The replicas no other process sharing the fleet claimed in the last ``hold_s``."""
        ...


@runtime_checkable
class DiscoveryLedger(Protocol):
    """A view that keeps which discovery registered each replica, across restarts (Redis): a
    discovery started later removes the replicas of its ``source`` whose pods went away."""

    def discovered(self, source: str) -> set[str]:
        """The replicas ``source`` registered and did not remove since."""
        ...

    def mark_discovered(self, replica: str, source: str) -> None: ...

    def unmark_discovered(self, replica: str) -> None: ...
