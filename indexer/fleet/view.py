"""The fleet as an API process sees it: a :class:`RegistryView` over the Redis hashes ``FleetSync``
writes, read from a snapshot cached ``cache_ttl_s`` (the last one through an outage, which
:meth:`RedisFleetView.outage` names); health records change in optimistic transactions. A
sharded stream whose claim is no live lease's reads orphaned (scored as stale)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

import msgspec
import redis

from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.domain.health import UnroutedCounters
from kvindex.indexer.fleet.registry import (
    Freshness,
    HealthChange,
    HealthUpdate,
    StreamFreshness,
    StreamStatus,
    most_common,
    snapshot,
    stream_freshness,
)
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.fleet.replica_health import HEALTHY, ReplicaHealth
from kvindex.indexer.fleet.sync import (
    StreamRecord,
    decode_record,
    decode_spec,
    decode_unrouted,
    encode_spec,
    specs_of,
)
from kvindex.indexer.index.circuit import StoreCircuit
from kvindex.indexer.index.protocol import IndexUnavailableError
from kvindex.indexer.index.redis import unavailable_on_connection_errors
from kvindex.indexer.redis.connection import RedisClient
from kvindex.indexer.redis.lua import lua_script
from kvindex.indexer.redis.schema import FLEET_MARKER, UNROUTED_FIELD, Schema, check_name

T = TypeVar("T")
log = logging.getLogger("kvindex.fleet")

_HEALTH_DECODER = msgspec.json.Decoder(ReplicaHealth)
_HEALTH_ENCODER = msgspec.json.Encoder()
_HEALTH_ATTEMPTS = 5  # tries of a health update other processes' writes keep invalidating


@dataclass(frozen=True, slots=True)
class _Fleet:
    specs: dict[str, ReplicaSpec] = field(default_factory=dict)
    statuses: list[StreamStatus] = field(default_factory=list)  # of ``specs``, sorted
    marked: bool = False  # the indexer's marker was there (absent: Redis lost the fleet)
    unrouted: UnroutedCounters = field(default_factory=UnroutedCounters)
    health: dict[str, ReplicaHealth] = field(default_factory=dict)
    now: float = 0.0  # when it was read


def _same_streams(a: _Fleet, b: _Fleet) -> bool:
    """The same specs and the same streams (what ``streams_version`` stands for)."""
    if a is b:
        return True
    if len(a.statuses) != len(b.statuses) or a.specs != b.specs:
        return False
    return all(x.stream == y.stream for x, y in zip(a.statuses, b.statuses, strict=True))


class RedisFleetView:
    """A thread-safe :class:`~kvindex.indexer.fleet.registry.RegistryView` backed by Redis."""

    def __init__(
        self,
        client: RedisClient,
        schema: Schema | None = None,
        *,
        stale_after_s: float = 300.0,
        record_expiry_s: float = 10.0,
        cache_ttl_s: float = 0.5,
        clock: Callable[[], float] = time.time,
        circuit: StoreCircuit | None = None,
    ) -> None:
        self._client = client
        self._circuit = circuit
        self._schema = schema or Schema()
        self._stale_after_s = stale_after_s
        self._record_expiry_s = record_expiry_s
        """A status not rewritten for this long means no indexer keeps it: stale."""
        self._cache_ttl_s = cache_ttl_s
        self._clock = clock
        self._remove = client.register_script(lua_script(__name__, "remove_replica.lua"))
        self._kept = client.register_script(lua_script(__name__, "kept_streams.lua"))
        self._lock = threading.Lock()
        self._fleet = _Fleet()
        self._generation = 0
        self._down: tuple[_Fleet, list[StreamId]] | None = None
        self._fresh: tuple[_Fleet, dict[StreamId, StreamFreshness]] | None = None
        """Each stream's freshness in the snapshot it was made from (made once a snapshot)."""
        self._expires = float("-inf")
        self._outage: str | None = None
        self.num_errors = 0

    # --- writes --------------------------------------------------------------------------

    def add(self, spec: ReplicaSpec) -> bool:
        if not self._guarded(self._write_spec, spec):
            return False
        self._invalidate()
        return True

    def _write_spec(self, spec: ReplicaSpec) -> bool:
        with unavailable_on_connection_errors():
            raw = cast("bytes | None", self._client.hget(self._schema.replicas, spec.id))
            if raw is not None and decode_spec(raw) == spec:
                return False
            self._client.hset(self._schema.replicas, spec.id, encode_spec(spec))
        return True

    def remove(self, replica: str) -> ReplicaSpec | None:
        check_name("replica id", replica)
        keys = [self._schema.replicas, self._schema.stream_status, self._schema.replica_health]
        raw = self._guarded(self._remove_spec, keys, replica)
        with self._lock:
            self._expires = float("-inf")
            if replica in self._fleet.specs:  # the snapshot may be kept (Redis lost it)
                specs = {k: v for k, v in self._fleet.specs.items() if k != replica}
                statuses = [s for s in self._fleet.statuses if s.stream.replica != replica]
                health = {k: v for k, v in self._fleet.health.items() if k != replica}
                self._fleet = replace(self._fleet, specs=specs, statuses=statuses, health=health)
                self._generation += 1
        return None if raw is None else decode_spec(raw)

    def _remove_spec(self, keys: list[str], replica: str) -> bytes | None:
        with unavailable_on_connection_errors():
            return cast("bytes | None", self._remove(keys=keys, args=[replica]))

    # --- discovery's ledger (a DiscoveryLedger) --------------------------------------------

    def discovered(self, source: str) -> set[str]:
        raw = self._guarded(self._hgetall, self._schema.discovered)
        owner = source.encode()
        return {replica.decode() for replica, by in raw.items() if by == owner}

    def _hgetall(self, key: str) -> dict[bytes, bytes]:
        with unavailable_on_connection_errors():
            return cast("dict[bytes, bytes]", self._client.hgetall(key))

    def mark_discovered(self, replica: str, source: str) -> None:
        self._guarded(self._hset, self._schema.discovered, replica, source)

    def _hset(self, key: str, field: str, value: str) -> None:
        with unavailable_on_connection_errors():
            self._client.hset(key, field, value)

    def unmark_discovered(self, replica: str) -> None:
        self._guarded(self._hdel, self._schema.discovered, replica)

    def _hdel(self, key: str, field: str) -> None:
        with unavailable_on_connection_errors():
            self._client.hdel(key, field)

    def _guarded(self, fn: Callable[..., T], *args: Any, probe: bool = True) -> T:
        """Through the circuit when there is one (reads never as its probe)."""
        if self._circuit is None:
            return fn(*args)
        if probe:
            return self._circuit.call(fn, *args)
        return self._circuit.call_if_closed(fn, *args)

    # --- reads ---------------------------------------------------------------------------

    def replicas(self) -> list[ReplicaSpec]:
        return sorted(self._current().specs.values(), key=lambda r: r.id)

    def get(self, replica: str) -> ReplicaSpec | None:
        return self._current().specs.get(replica)

    def models(self) -> list[str]:
        return sorted({r.model for r in self._current().specs.values()})

    def statuses(self) -> list[StreamStatus]:
        return list(self._current().statuses)

    def stream_ids(self) -> list[StreamId]:
        return [s.stream for s in self._current().statuses]

    def streams_version(self) -> int:
        self._current()
        return self._generation

    def freshness(self, streams: Collection[StreamId] | None = None) -> list[StreamFreshness]:
        fleet = self._current()
        fresh = self._fresh
        if fresh is None or fresh[0] is not fleet:
            fresh = self._fresh = (fleet, _freshness_of(fleet.statuses, fleet.now))
        of_stream = fresh[1]
        if streams is None:
            return list(of_stream.values())
        return [of_stream[s] for s in streams if s in of_stream]

    def disconnected(self) -> list[StreamId]:
        fleet = self._current()
        down = self._down
        if down is None or down[0] is not fleet:
            down = self._down = (
                fleet,
                [s.stream for s in fleet.statuses if not s.health.connected],
            )
        return list(down[1])

    def replica_health(self) -> dict[str, ReplicaHealth]:
        return dict(self._current().health)

    def update_health(self, changes: dict[str, HealthChange]) -> dict[str, HealthUpdate]:
        if not changes:
            return {}
        out = self._guarded(self._update_health, changes)
        self._invalidate()
        return out

    def _update_health(self, changes: dict[str, HealthChange]) -> dict[str, HealthUpdate]:
        key, replicas = self._schema.replica_health, list(changes)
        with unavailable_on_connection_errors(), self._client.pipeline(True) as pipe:
            for _ in range(_HEALTH_ATTEMPTS):
                try:
                    pipe.watch(key, self._schema.replicas)
                    known = cast("list[bytes | None]", pipe.hmget(self._schema.replicas, replicas))
                    raw = cast("list[bytes | None]", pipe.hmget(key, replicas))
                    out: dict[str, HealthUpdate] = {}
                    for replica, spec, old in zip(replicas, known, raw, strict=True):
                        if spec is not None:
                            before = _health_of(old)
                            out[replica] = (before, changes[replica](before))
                    pipe.multi()
                    if out:
                        mapping = {r: _HEALTH_ENCODER.encode(a) for r, (_, a) in out.items()}
                        pipe.hset(key, mapping=mapping)  # type: ignore[arg-type]
                    pipe.execute()
                    return out
                except redis.WatchError:
                    continue
        raise IndexUnavailableError("replica health: too many concurrent writers, not updated")

    def ask_clear(self, replica: str, at: float | None = None) -> None:
        """``Registry.ask_clear`` through Redis (``FleetSync`` hands it to the indexer that
        keeps the streams); IndexUnavailableError when Redis is down."""
        stamp = time.time() if at is None else at
        self._guarded(self._ask_clear, replica, stamp)

    def _ask_clear(self, replica: str, stamp: float) -> None:
        with unavailable_on_connection_errors():
            self._client.hset(self._schema.clear_asks, replica, repr(stamp))

    def claim_health_checks(self, replicas: Sequence[str], hold_s: float) -> set[str]:
        """SET NX PX per replica (one round trip); Redis down: IndexUnavailableError."""
        wanted = list(dict.fromkeys(replicas))
        if not wanted:
            return set()
        hold_ms = max(1, round(hold_s * 1000))
        return self._guarded(self._claim, wanted, hold_ms)

    def _claim(self, replicas: list[str], hold_ms: int) -> set[str]:
        with unavailable_on_connection_errors(), self._client.pipeline(False) as pipe:
            for replica in replicas:
                pipe.set(self._schema.health_claim(replica), b"1", nx=True, px=hold_ms)
            won = pipe.execute()
        return {r for r, ok in zip(replicas, won, strict=True) if ok}

    def unrouted(self) -> UnroutedCounters:
        return self._current().unrouted

    def outage(self) -> str | None:
        self._current()
        return self._outage

    def block_size(self, model: str) -> int | None:
        fleet = self._current()
        sizes = [
            size
            for s in fleet.statuses
            if (size := s.health.block_size)
            and (spec := fleet.specs.get(s.stream.replica))
            and spec.model == model
        ]
        return most_common(sizes)

    # --- the cached snapshot -------------------------------------------------------------

    def _invalidate(self) -> None:
        with self._lock:
            self._expires = float("-inf")

    def _current(self) -> _Fleet:
        with self._lock:
            now = self._clock()
            if now < self._expires:
                return self._fleet
            try:
                self._refresh(self._guarded(self._read, now, probe=False))
            except (IndexUnavailableError, redis.RedisError) as exc:
                self.num_errors += 1
                self._set_outage(f"fleet state unreadable, serving the last one read: {exc}")
            self._expires = now + self._cache_ttl_s
            return self._fleet

    def _refresh(self, fleet: _Fleet) -> None:
        """Take a good read, unless Redis lost the fleet: then keep the last, merged."""
        before = self._fleet
        self._take(fleet)
        if not _same_streams(before, self._fleet):
            self._generation += 1

    def _take(self, fleet: _Fleet) -> None:
        if fleet.marked or not self._fleet.marked:
            self._fleet = fleet
            self._set_outage(None)
            return
        specs = {**self._fleet.specs, **fleet.specs}
        statuses = {s.stream: s for s in [*self._fleet.statuses, *fleet.statuses]}
        ordered = sorted(statuses.values(), key=lambda s: s.stream)
        health = {**self._fleet.health, **fleet.health}
        self._fleet = _Fleet(specs, ordered, True, fleet.unrouted, health, fleet.now)
        self._set_outage("fleet state lost by redis (restarted empty?), serving the last one")

    def _set_outage(self, outage: str | None) -> None:
        if (outage is None) != (self._outage is None):
            if outage is None:
                log.warning("fleet state readable again")
            else:
                log.warning("%s", outage)
        self._outage = outage

    def _kept_streams(self, records: dict[StreamId, StreamRecord | None]) -> set[StreamId]:
        """The sharded streams a live indexer keeps (no round trip when none is sharded)."""
        if all(r is None or r.owner is None for r in records.values()):
            return set()
        keys = [self._schema.indexers, self._schema.stream_owners]
        with unavailable_on_connection_errors():
            reply = cast("list[bytes]", self._kept(keys=keys))
        return {StreamId.parse(name.decode()) for name in reply}

    def _read(self, now: float) -> _Fleet:
        with unavailable_on_connection_errors(), self._client.pipeline(False) as pipe:
            pipe.hgetall(self._schema.replicas)
            pipe.hgetall(self._schema.stream_status)
            pipe.hgetall(self._schema.replica_health)
            replies = cast("list[dict[bytes, bytes]]", pipe.execute())
        specs, raw = specs_of(replies[0]), replies[1]
        unrouted = decode_unrouted(raw.pop(UNROUTED_FIELD.encode(), None))
        records = {StreamId.parse(k.decode()): decode_record(v) for k, v in raw.items()}
        kept = self._kept_streams(records)
        statuses = []
        for stream, record in records.items():
            if record is None or stream.replica not in specs:
                continue
            expired = now - record.written_at > self._record_expiry_s
            freshness = Freshness.STALE if expired else None
            if record.owner is not None and stream not in kept:
                freshness = Freshness.ORPHANED
            statuses.append(
                snapshot(
                    stream,
                    record.health,
                    now=now,
                    stale_after_s=self._stale_after_s,
                    freshness=freshness,
                    owner=record.owner,
                )
            )
        marked = FLEET_MARKER.encode() in replies[0]
        named = {key.decode(): value for key, value in replies[2].items()}
        health = {r: _health_of(value) for r, value in named.items() if r in specs}
        ordered = sorted(statuses, key=lambda s: s.stream)
        return _Fleet(specs, ordered, marked, unrouted, health, now)


def _scored(freshness: Freshness) -> Freshness:
    """What the scorer weighs: an orphaned stream's entries are as old as a stale one's."""
    return Freshness.STALE if freshness is Freshness.ORPHANED else freshness


def _health_of(raw: bytes | None) -> ReplicaHealth:
    """A stored health record; absent or undecodable (logged): the healthy default."""
    if raw is None:
        return HEALTHY
    try:
        return _HEALTH_DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        log.warning("ignoring an undecodable stored replica health record: %s", exc)
        return HEALTHY


def _freshness_of(statuses: Sequence[StreamStatus], now: float) -> dict[StreamId, StreamFreshness]:
    """Each stream's freshness at ``now``, in the statuses' order."""
    return {
        s.stream: stream_freshness(s.stream, s.health, _scored(s.freshness), s.silent_s, now)
        for s in statuses
    }
