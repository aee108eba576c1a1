"""The replicas kvindex knows, and the live state of each of their streams.

Replicas come from the settings (config file, command line), from run-time calls
(:meth:`Registry.add` / :meth:`Registry.remove`, exposed over HTTP by the API) and, in
bind mode, from the topic ``kv@<replica>@<model>`` of their first event. The subscriber
thread writes stream status; any thread may read a consistent snapshot.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

from kvindex.indexer.events import StreamId
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.stream import StreamCounters


class Freshness(enum.Enum):
    """How far a stream's index entries can be trusted right now."""

    LIVE = "live"
    REPLAYING = "replaying"
    STALE = "stale"


@dataclass(frozen=True, slots=True)
class StreamStatus:
    """A snapshot of one stream's ingestion state."""

    stream: StreamId
    freshness: Freshness
    connected: bool
    last_seq: int
    last_event_ts: float | None
    """Engine timestamp of the last applied batch."""
    lag_s: float | None
    """Receive time minus engine timestamp of the last applied batch."""
    silent_s: float | None
    """Seconds since anything was heard from the stream."""
    counters: StreamCounters
    block_size: int = 0
    """Tokens per block in this stream's events (0 until a store with tokens is seen)."""
    num_decode_errors: int = 0
    num_store_errors: int = 0
    num_orphan_stores: int = 0
    num_unknown_removals: int = 0
    num_misaligned_events: int = 0
    num_bad_events: int = 0


class StreamFreshness(NamedTuple):
    """The part of a stream's status a scorer needs (cheap: no counters copied)."""

    stream: StreamId
    freshness: Freshness
    lag_s: float | None
    silent_s: float | None


@dataclass(slots=True)
class LiveState:
    """Mutable per-stream state, written by the subscriber thread under the registry's lock.

    Every timestamp is wall-clock (``time.time``), so another process can read a copy
    (``kvindex.indexer.fleet.sync``) and compute silence and staleness itself."""

    connected: bool = False
    replaying: bool = False
    last_seq: int = -1
    last_event_ts: float | None = None
    lag_s: float | None = None
    last_heard: float | None = None
    disconnected_at: float | None = None
    counters: StreamCounters = field(default_factory=StreamCounters)
    block_size: int = 0
    num_decode_errors: int = 0
    num_store_errors: int = 0
    num_orphan_stores: int = 0
    num_unknown_removals: int = 0
    num_misaligned_events: int = 0
    num_bad_events: int = 0


class Registry:
    """Thread-safe map of replica id → spec, plus per-stream live state."""

    def __init__(
        self,
        replicas: tuple[ReplicaSpec, ...] = (),
        *,
        stale_after_s: float = 300.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._lock = threading.Lock()
        self._replicas: dict[str, ReplicaSpec] = {r.id: r for r in replicas}
        self._live: dict[StreamId, LiveState] = {}
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._version = 0

    # --- replicas ------------------------------------------------------------------------

    def add(self, spec: ReplicaSpec) -> bool:
        """Register or update a replica; False if an identical spec was already there."""
        with self._lock:
            if self._replicas.get(spec.id) == spec:
                return False
            self._replicas[spec.id] = spec
            self._version += 1
            return True

    def remove(self, replica: str) -> ReplicaSpec | None:
        """Forget a replica and its streams' state; returns the removed spec."""
        with self._lock:
            spec = self._replicas.pop(replica, None)
            for stream in [s for s in self._live if s.replica == replica]:
                del self._live[stream]
            if spec is not None:
                self._version += 1
            return spec

    def get(self, replica: str) -> ReplicaSpec | None:
        with self._lock:
            return self._replicas.get(replica)

    def replicas(self) -> list[ReplicaSpec]:
        with self._lock:
            return sorted(self._replicas.values(), key=lambda r: r.id)

    @property
    def version(self) -> int:
        """Bumped on every add/remove, so the subscriber knows to reconcile its sockets."""
        with self._lock:
            return self._version

    def models(self) -> list[str]:
        with self._lock:
            return sorted({r.model for r in self._replicas.values()})

    # --- stream state (written by the subscriber) ----------------------------------------

    def update(self, stream: StreamId, **changes: object) -> None:
        """Set fields of a stream's live state (creating it)."""
        with self._lock:
            live = self._live.get(stream)
            if live is None:
                live = self._live[stream] = LiveState()
            for name, value in changes.items():
                setattr(live, name, value)

    def count(self, stream: StreamId, **amounts: int) -> None:
        """Add to ``num_*`` counters of a stream's live state."""
        with self._lock:
            live = self._live.get(stream)
            if live is None:
                live = self._live[stream] = LiveState()
            for name, amount in amounts.items():
                setattr(live, name, getattr(live, name) + amount)

    def heard(self, stream: StreamId, *, seq: int, engine_ts: float) -> None:
        """Record an applied batch: its seq, engine timestamp and the lag behind it."""
        now = self._clock()
        with self._lock:
            live = self._live.get(stream)
            if live is None:
                live = self._live[stream] = LiveState()
            live.last_seq = seq
            live.last_event_ts = engine_ts
            live.lag_s = max(0.0, now - engine_ts)
            live.last_heard = now

    # --- reading -------------------------------------------------------------------------

    def status(self, stream: StreamId) -> StreamStatus | None:
        with self._lock:
            live = self._live.get(stream)
            return None if live is None else self._snapshot(stream, live)

    def stream_ids(self) -> list[StreamId]:
        """The streams with live state (cheap: no snapshot)."""
        with self._lock:
            return list(self._live)

    def freshness(self) -> list[StreamFreshness]:
        """Freshness, lag and silence of every stream, read in one go."""
        now = self._clock()
        with self._lock:
            views = []
            for stream, live in self._live.items():
                silent = None if live.last_heard is None else now - live.last_heard
                fresh = freshness_of(live, silent, self._stale_after_s)
                views.append(StreamFreshness(stream, fresh, live.lag_s, silent))
            return views

    def statuses(self) -> list[StreamStatus]:
        with self._lock:
            return [self._snapshot(s, live) for s, live in sorted(self._live.items())]

    def _snapshot(self, stream: StreamId, live: LiveState) -> StreamStatus:
        return snapshot(stream, live, now=self._clock(), stale_after_s=self._stale_after_s)

    def live_states(self) -> dict[StreamId, LiveState]:
        """A copy of every stream's live state (for publishing it to other processes)."""
        with self._lock:
            return {
                s: replace(live, counters=replace(live.counters)) for s, live in self._live.items()
            }

    def block_size(self, model: str) -> int | None:
        """The block size the model's replicas publish (the most common one), if seen."""
        with self._lock:
            replicas = {r.id for r in self._replicas.values() if r.model == model}
            sizes = [
                live.block_size
                for stream, live in self._live.items()
                if stream.replica in replicas and live.block_size
            ]
        return most_common(sizes)

    def disconnected_for(self, stream: StreamId) -> float | None:
        """Seconds a connect-mode stream has been disconnected (None if connected/unknown)."""
        with self._lock:
            live = self._live.get(stream)
            if live is None or live.connected or live.disconnected_at is None:
                return None
            return self._clock() - live.disconnected_at


def freshness_of(live: LiveState, silent_s: float | None, stale_after_s: float) -> Freshness:
    """The freshness rule, shared by the in-process registry and the Redis fleet view."""
    if live.replaying:
        return Freshness.REPLAYING
    if silent_s is not None and silent_s > stale_after_s:
        return Freshness.STALE
    if not live.connected and live.disconnected_at is not None:
        return Freshness.STALE
    return Freshness.LIVE


def snapshot(
    stream: StreamId,
    live: LiveState,
    *,
    now: float,
    stale_after_s: float,
    freshness: Freshness | None = None,
) -> StreamStatus:
    """A stream's status as of ``now`` (``freshness`` overrides the computed one)."""
    silent = None if live.last_heard is None else max(0.0, now - live.last_heard)
    return StreamStatus(
        stream=stream,
        freshness=freshness or freshness_of(live, silent, stale_after_s),
        connected=live.connected,
        last_seq=live.last_seq,
        last_event_ts=live.last_event_ts,
        lag_s=live.lag_s,
        silent_s=silent,
        counters=replace(live.counters),
        block_size=live.block_size,
        num_decode_errors=live.num_decode_errors,
        num_store_errors=live.num_store_errors,
        num_orphan_stores=live.num_orphan_stores,
        num_unknown_removals=live.num_unknown_removals,
        num_misaligned_events=live.num_misaligned_events,
        num_bad_events=live.num_bad_events,
    )


def most_common(sizes: list[int]) -> int | None:
    return max(set(sizes), key=sizes.count) if sizes else None


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

    def freshness(self) -> list[StreamFreshness]: ...

    def stream_ids(self) -> list[StreamId]: ...

    def block_size(self, model: str) -> int | None: ...
