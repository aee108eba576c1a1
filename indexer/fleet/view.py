"""The fleet as an API process sees it: a :class:`RegistryView` over the Redis hashes an
indexer's :class:`~kvindex.indexer.fleet.sync.FleetSync` writes (names in ``redis_schema``).

Reads come from one snapshot (both hashes, one round trip) cached for ``cache_ttl_s``, so
``/score`` does not ask Redis for the fleet on every request. When Redis cannot be read the
last snapshot keeps serving (logged): ``/score`` then degrades on the index, not here.
``add``/``remove`` write through (raising :class:`IndexUnavailableError` when Redis is
down) and drop the cache, so this view sees its own writes at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import redis

from kvindex.indexer.events import StreamId
from kvindex.indexer.fleet.registry import (
    Freshness,
    StreamFreshness,
    StreamStatus,
    most_common,
    snapshot,
)
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.fleet.sync import decode_record, decode_spec, encode_spec, read_replicas
from kvindex.indexer.health import UnroutedCounters
from kvindex.indexer.index.redis import unavailable_on_connection_errors
from kvindex.indexer.redis_schema import Schema, check_name

log = logging.getLogger("kvindex.fleet")

_REMOVE_LUA = """
local spec = redis.call('HGET', KEYS[1], ARGV[1])
if not spec then return false end
redis.call('HDEL', KEYS[1], ARGV[1])
local prefix = ARGV[1] .. '/'
for _, f in ipairs(redis.call('HKEYS', KEYS[2])) do
  if string.sub(f, 1, #prefix) == prefix then redis.call('HDEL', KEYS[2], f) end
end
return spec
"""
"""Drop a replica's spec and its streams' statuses atomically; returns the spec or nil."""


@dataclass(frozen=True, slots=True)
class _Fleet:
    specs: dict[str, ReplicaSpec] = field(default_factory=dict)
    statuses: list[StreamStatus] = field(default_factory=list)
    """Statuses of the streams of ``specs`` only, sorted by stream."""


class RedisFleetView:
    """A thread-safe :class:`~kvindex.indexer.fleet.registry.RegistryView` backed by Redis."""

    def __init__(
        self,
        client: redis.Redis,
        schema: Schema | None = None,
        *,
        stale_after_s: float = 300.0,
        record_expiry_s: float = 10.0,
        cache_ttl_s: float = 0.5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._schema = schema or Schema()
        self._stale_after_s = stale_after_s
        self._record_expiry_s = record_expiry_s
        """A status not rewritten for this long means no indexer keeps it: stale."""
        self._cache_ttl_s = cache_ttl_s
        self._clock = clock
        self._remove = client.register_script(_REMOVE_LUA)
        self._lock = threading.Lock()
        self._fleet = _Fleet()
        self._expires = float("-inf")
        self.num_errors = 0

    # --- writes --------------------------------------------------------------------------

    def add(self, spec: ReplicaSpec) -> bool:
        """Register or update a replica; False if an identical spec was already there."""
        with unavailable_on_connection_errors():
            raw = cast("bytes | None", self._client.hget(self._schema.replicas, spec.id))
            if raw is not None and decode_spec(raw) == spec:
                return False
            self._client.hset(self._schema.replicas, spec.id, encode_spec(spec))
        self._invalidate()
        return True

    def remove(self, replica: str) -> ReplicaSpec | None:
        """Forget a replica and its streams' statuses (one script); returns the removed spec."""
        check_name("replica id", replica)
        keys = [self._schema.replicas, self._schema.stream_status]
        with unavailable_on_connection_errors():
            raw = cast("bytes | None", self._remove(keys=keys, args=[replica]))
        self._invalidate()
        return None if raw is None else decode_spec(raw)

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

    def freshness(self) -> list[StreamFreshness]:
        return [
            StreamFreshness(s.stream, s.freshness, s.health.lag_s, s.silent_s)
            for s in self._current().statuses
        ]

    def unrouted(self) -> UnroutedCounters:
        """Zeros: the indexer does not publish its bound SUB's unrouted counters to Redis
        (yet); its own process reads them from its registry."""
        return UnroutedCounters()

    def block_size(self, model: str) -> int | None:
        """The block size the model's replicas publish (the most common one), if seen."""
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
                self._fleet = self._read(now)
            except redis.RedisError as exc:
                self.num_errors += 1
                log.warning("fleet state unreadable, serving the last one: %s", exc)
            self._expires = now + self._cache_ttl_s
            return self._fleet

    def _read(self, now: float) -> _Fleet:
        specs = read_replicas(self._client, self._schema)
        raw = cast("dict[bytes, bytes]", self._client.hgetall(self._schema.stream_status))
        statuses = []
        for key, value in raw.items():
            stream = StreamId.parse(key.decode())
            record = decode_record(value)
            if record is None or stream.replica not in specs:
                continue
            expired = now - record.written_at > self._record_expiry_s
            statuses.append(
                snapshot(
                    stream,
                    record.health,
                    now=now,
                    stale_after_s=self._stale_after_s,
                    freshness=Freshness.STALE if expired else None,
                )
            )
        return _Fleet(specs, sorted(statuses, key=lambda s: s.stream))
