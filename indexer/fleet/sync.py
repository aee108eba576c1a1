"""The fleet state an indexer shares through Redis (replica id → spec, stream → record), so API
processes see what it sees; a Redis error is counted and logged, never fatal. A sharded
indexer's records are fenced by its lease (``publish_status.lua``): none without one."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import cast

import msgspec
import redis

from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.domain.health import StreamHealth, UnroutedCounters
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.redis.connection import RedisClient
from kvindex.indexer.redis.lua import lua_script
from kvindex.indexer.redis.schema import FLEET_MARKER, UNROUTED_FIELD, Schema

log = logging.getLogger("kvindex.fleet")


class StreamRecord(msgspec.Struct, frozen=True):
    """One stream's record as published by the indexer."""

    health: StreamHealth = msgspec.field(name="live")  # the wire name older releases read
    written_at: float
    """Writer's wall clock at the write; a reader treats an old record as stale."""
    owner: str | None = None  # the sharded indexer that wrote it


_SPEC_DECODER = msgspec.json.Decoder(ReplicaSpec)
_RECORD_DECODER = msgspec.json.Decoder(StreamRecord)
_UNROUTED_DECODER = msgspec.json.Decoder(UnroutedCounters)
_ENCODER = msgspec.json.Encoder()


def encode_spec(spec: ReplicaSpec) -> bytes:
    return _ENCODER.encode(spec)


def decode_spec(raw: bytes) -> ReplicaSpec | None:
    """The stored spec, or None (logged) when it cannot be decoded or is invalid."""
    try:
        return _SPEC_DECODER.decode(raw)
    except (msgspec.DecodeError, KvIndexError) as exc:
        log.warning("ignoring an undecodable stored replica spec: %s", exc)
        return None


def encode_record(record: StreamRecord) -> bytes:
    return _ENCODER.encode(record)


def encode_unrouted(counters: UnroutedCounters) -> bytes:
    return _ENCODER.encode(counters)


def decode_unrouted(raw: bytes | None) -> UnroutedCounters:
    """The stored counters; zeros when there are none or they cannot be decoded."""
    if raw is None:
        return UnroutedCounters()
    try:
        return _UNROUTED_DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        log.warning("ignoring undecodable stored unrouted counters: %s", exc)
        return UnroutedCounters()


def decode_record(raw: bytes) -> StreamRecord | None:
    try:
        return _RECORD_DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        log.warning("ignoring an undecodable stored stream status: %s", exc)
        return None


def read_replicas(client: RedisClient, schema: Schema) -> dict[str, ReplicaSpec]:
    """Every stored replica spec (undecodable ones skipped)."""
    raw = cast("dict[bytes, bytes]", client.hgetall(schema.replicas))
    return specs_of(raw)


def specs_of(raw: dict[bytes, bytes]) -> dict[str, ReplicaSpec]:
    specs = {k.decode(): decode_spec(v) for k, v in raw.items() if k != FLEET_MARKER.encode()}
    return {k: s for k, s in specs.items() if s is not None and s.id == k}


class FleetSync:
    """Mirrors the in-process registry to and from Redis: ``tick`` is the whole job,
    ``start`` runs it every ``period_s`` in a daemon thread. Not reentrant. ``lease``: a
    sharded indexer's current lease token, checked by every status write."""

    def __init__(
        self,
        client: RedisClient,
        schema: Schema,
        registry: Registry,
        *,
        declared: tuple[ReplicaSpec, ...] = (),
        period_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        owner: str | None = None,
        lease: Callable[[], str] | None = None,
    ) -> None:
        self._owner = owner
        self._lease = lease
        self._publish = client.register_script(lua_script(__name__, "publish_status.lua"))
        self._refused = False
        self._client = client
        self._schema = schema
        self._registry = registry
        self._declared = declared
        self._period_s = period_s
        self._clock = clock
        self._known: set[str] = set()
        self._asks_seen: dict[str, float] | None = None  # None: none read yet

        self._written: set[str] = set()

        self._declared_written = False
        self.num_errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        registry.read_prior_views(self.prior_view)

    def prior_view(self, stream: StreamId) -> tuple[str, float] | None:
        """(reason, since) if the stream's published record says its view is partial; None
        when it is whole, absent or unreadable (a Redis error is counted and logged)."""
        try:
            raw = cast("bytes | None", self._client.hget(self._schema.stream_status, str(stream)))
        except redis.RedisError as exc:
            self.num_errors += 1
            log.warning("stream %s: its published record could not be read: %s", stream, exc)
            return None
        record = None if raw is None else decode_record(raw)
        if record is None or record.health.partial is None:
            return None
        return record.health.partial, record.health.partial_since or record.written_at

    def start(self) -> None:
        """Publish the declared replicas and sync once (now), then every period."""
        self.tick()
        self._thread = threading.Thread(target=self._run, name="kvindex-fleet", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            self.tick()

    def tick(self) -> None:
        """One sync; a Redis error is counted and logged and the next tick tries again."""
        try:
            if not self._declared_written:
                self._write_declared()
            self._pull_replicas()
            self._pull_clear_asks()
            self._push_statuses()
        except redis.RedisError as exc:
            self.num_errors += 1
            log.warning("fleet sync with redis failed (%d so far): %s", self.num_errors, exc)

    def _write_declared(self) -> None:
        if self._declared:
            mapping = {s.id: encode_spec(s) for s in self._declared}
            self._client.hset(self._schema.replicas, mapping=mapping)  # type: ignore[arg-type]
        self._known |= {s.id for s in self._declared}
        self._declared_written = True

    def _pull_replicas(self) -> None:
        raw = cast("dict[bytes, bytes]", self._client.hgetall(self._schema.replicas))
        if FLEET_MARKER.encode() not in raw:
            self._republish()
            raw = cast("dict[bytes, bytes]", self._client.hgetall(self._schema.replicas))
        stored = specs_of(raw)
        for spec in stored.values():
            if self._registry.add(spec):
                log.info("replica %s: registered from the shared fleet state", spec.id)
        for spec in self._registry.replicas():
            if spec.id in stored:
                continue
            if spec.id in self._known:  # removed by another process (DELETE /replicas)
                self._registry.remove(spec.id)
                log.info("replica %s: removed from the shared fleet state", spec.id)
            else:  # learnt here (bind mode, first event): share it
                self._client.hset(self._schema.replicas, spec.id, encode_spec(spec))
                stored[spec.id] = spec
        self._known = set(stored)

    def _pull_clear_asks(self) -> None:
        """Hand the proxies' asks to drop a replica's blocks to the pipelines; those already
        there at the first read are old news (an indexer restarted later must not act)."""
        raw = cast("dict[bytes, bytes]", self._client.hgetall(self._schema.clear_asks))
        asks = {k.decode(): _stamp(v) for k, v in raw.items()}
        seen, self._asks_seen = self._asks_seen, asks
        if seen is None:
            return
        for replica, at in asks.items():
            if at > seen.get(replica, float("-inf")):
                self._registry.ask_clear(replica, at)

    def _republish(self) -> None:
        """Redis lost the hash: our registry, merged with what is there, is the truth."""
        mapping = {s.id: encode_spec(s) for s in self._registry.replicas()}
        mapping[FLEET_MARKER] = b"1"
        self._client.hset(self._schema.replicas, mapping=mapping)  # type: ignore[arg-type]
        log.info("fleet state published to redis (%d replicas)", len(mapping) - 1)
        self._known = set(mapping) - {FLEET_MARKER}

    def _push_statuses(self) -> None:
        replicas = {r.id for r in self._registry.replicas()}
        now = self._clock()
        records = {
            str(stream): encode_record(StreamRecord(health, now, self._owner))
            for stream, health in self._registry.records().items()
            if stream.replica in replicas
        }
        gone = self._written - set(records)
        if self._owner is not None:  # a stream handed over: its new owner rewrites it
            gone = {f for f in gone if StreamId.parse(f).replica not in replicas}
        unrouted = encode_unrouted(self._registry.unrouted())
        if self._lease is not None:
            self._publish_fenced(self._lease(), unrouted, records, gone)
            return
        with self._client.pipeline(transaction=True) as pipe:
            pipe.hset(self._schema.stream_status, UNROUTED_FIELD, unrouted)
            if records:
                pipe.hset(self._schema.stream_status, mapping=records)  # type: ignore[arg-type]
            if gone:
                pipe.hdel(self._schema.stream_status, *gone)
            pipe.execute()
        self._written = set(records)

    def _publish_fenced(
        self, token: str, unrouted: bytes, records: dict[str, bytes], gone: set[str]
    ) -> None:
        keys = [self._schema.indexers, self._schema.stream_owners, self._schema.stream_status]
        args: list[str | bytes | int] = [token, UNROUTED_FIELD, unrouted, len(records)]
        for stream, record in records.items():
            args += (stream, record)
        args += sorted(gone)
        refused = int(cast("int", self._publish(keys=keys, args=args))) < 0
        if refused and records and not self._refused:
            log.warning("stream records not published: lease %s not held", token)
        self._refused = refused
        if not refused:
            self._written = set(records)


def _stamp(raw: bytes) -> float:
    try:
        return float(raw)
    except ValueError:
        return float("-inf")  # never acted on
