"""Where load is kept: the :class:`LoadStore` Protocol, in-process and in Redis.

Both stores keep the newest load per replica (:func:`~kvindex.api.load.model.is_newer_or_same`)
and count the answers that chose it since; each owns the ledger of the requests in flight
that proxies reserve in it (:mod:`~kvindex.api.load.reservations`) and reads its totals
with the loads. ``tests/contract/test_load_contract.py`` and
``tests/contract/test_reservation_contract.py`` run one suite against both.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol, cast

import msgspec
import redis

from kvindex.api.load.model import (
    NO_IN_FLIGHT,
    CountedLoad,
    Load,
    LoadError,
    is_newer_or_same,
)
from kvindex.api.load.reservations import CircuitLedger, Ledger, MemoryLedger, RedisLedger
from kvindex.indexer.circuit import StoreCircuit
from kvindex.indexer.index.redis import unavailable_on_connection_errors
from kvindex.indexer.redis_connection import RedisClient
from kvindex.indexer.redis_schema import Schema, answers_field, check_name

logger = logging.getLogger(__name__)


class LoadStore(Protocol):
    """The latest load of each replica, and the answers that chose it since.

    Implementations are safe to call from any thread.
    """

    def put(self, replica: str, load: Load) -> None:
        """Keep ``load`` unless the stored one is newer (:func:`is_newer_or_same`), atomically.

        Raises ``SchemaError`` for a replica id unusable in a Redis key.
        """
        ...

    def get_many(self, replicas: Sequence[str]) -> dict[str, Load]:
        """The stored load of each replica; replicas without one are absent."""
        ...

    def get_counted(
        self, replicas: Sequence[str], answers: Sequence[str] = ()
    ) -> dict[str, CountedLoad]:
        """Count ``answers`` (the replica each chose) first, then read each replica's load
        with the answers counted for it since that load was stored and the requests in
        flight to it (:attr:`ledger`'s totals, every live lease's); replicas with neither a
        load nor a request in flight are absent, those with no load have ``load`` None. A
        put that stores a newer load starts its replica's count again; one that stores an
        equal ``ts`` (the same measurement) does not.

        An answer made on a load that a newer one replaced meanwhile counts toward the newer
        one: at most the answers in flight are over-counted, never lost.
        """
        ...

    @property
    def ledger(self) -> Ledger:
        """The requests in flight that proxies reserved in this store
        (:mod:`~kvindex.api.load.reservations`); :meth:`get_counted` reads its totals."""
        ...

    def claim_scrapes(self, replicas: Sequence[str], hold_s: float) -> set[str]:
        """The replicas this process is to scrape now: each one no other caller claimed in
        the last ``hold_s`` seconds (every one, for a store serving one process). API
        processes sharing a store thus scrape each replica once a round, not once each."""
        ...

    def remove(self, replica: str) -> None:
        """Forget the replica's load and answers (a no-op for an unknown replica)."""
        ...

    def close(self) -> None:
        """Release connections. The store must not be used afterwards."""
        ...


class MemoryLoadStore:
    """In-process :class:`LoadStore` (one API process). Thread-safe (one lock)."""

    def __init__(self, ledger: MemoryLedger | None = None) -> None:
        self._lock = threading.Lock()
        self._replica_to_load: dict[str, Load] = {}
        self._answers: dict[str, int] = {}
        """Per replica: answers that chose it since its load was stored."""
        self._counted: dict[str, CountedLoad] = {}
        """Per replica with a load: its load and answers, none in flight (kept as they
        change, so that a read copies the fleet's rather than building one per replica)."""
        self._ledger = ledger or MemoryLedger()

    @property
    def ledger(self) -> Ledger:
        return self._ledger

    def put(self, replica: str, load: Load) -> None:
        check_name("replica id", replica)
        with self._lock:
            old = self._replica_to_load.get(replica)
            if is_newer_or_same(load, old):
                self._replica_to_load[replica] = load
                if old is None or load.ts > old.ts:
                    self._answers.pop(replica, None)
                self._counted[replica] = CountedLoad(load, self._answers.get(replica, 0))

    def get_many(self, replicas: Sequence[str]) -> dict[str, Load]:
        with self._lock:
            return {r: self._replica_to_load[r] for r in replicas if r in self._replica_to_load}

    def get_counted(
        self, replicas: Sequence[str], answers: Sequence[str] = ()
    ) -> dict[str, CountedLoad]:
        in_flight = self._ledger.in_flight(replicas)
        with self._lock:
            counts, counted, loads = self._answers, self._counted, self._replica_to_load
            for replica in answers:
                count = counts[replica] = counts.get(replica, 0) + 1
                load = loads.get(replica)
                if load is not None:
                    counted[replica] = CountedLoad(load, count)
            if counted.keys() == set(replicas):  # the whole fleet asked: copy in one go
                out = counted.copy()
            else:
                out = {r: counted[r] for r in replicas if r in counted}
            for r, flying in in_flight.items():  # few: the replicas proxies reserved
                out[r] = CountedLoad(loads.get(r), counts.get(r, 0), flying)
            return out

    def claim_scrapes(self, replicas: Sequence[str], hold_s: float) -> set[str]:
        return set(replicas)

    def remove(self, replica: str) -> None:
        with self._lock:
            self._replica_to_load.pop(replica, None)
            self._answers.pop(replica, None)
            self._counted.pop(replica, None)

    def close(self) -> None:
        """Nothing to release."""


# KEYS[1] the load HASH; ARGV: replica, ts of the new load, the new load (JSON).
# Returns 1 when stored, 0 when the stored load is newer. An undecodable stored value
# counts as older: it is overwritten rather than blocking the replica forever.
_PUT_IF_NEWER_LUA = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
local newer = true
if old then
  local ok, decoded = pcall(cjson.decode, old)
  if ok and type(decoded) == 'table' then
    local old_ts = tonumber(decoded['ts'])
    if old_ts and old_ts > tonumber(ARGV[2]) then
      return 0
    end
    newer = not (old_ts and old_ts == tonumber(ARGV[2]))
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
if newer then
  redis.call('HDEL', KEYS[1], ARGV[4])  -- a new measurement: its answers start from 0
end
return 1
"""

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Load)


class RedisLoadStore:
    """Shared :class:`LoadStore`: one HASH (``Schema.load``) replica id → load as JSON.

    A put is one Lua script (compare ``ts``, then set: atomic across API processes); a
    ``get_many`` is one HMGET; a ``get_counted`` is one round trip (an HINCRBY per answer,
    then an HMGET, then the script reading the in-flight totals of its
    :class:`RedisLedger`, whose keys are apart: ``{inflight}``). A replica's answers are
    its field ``<replica>/answers`` of the same HASH (no replica id contains ``/``), so
    every other call touches one key; the put script deletes that field when it stores a
    newer load. Every method raises
    :class:`IndexUnavailableError` when Redis cannot be reached. A stored value that
    cannot be decoded reads as absent (logged). Scrape claims are short-lived keys
    (``Schema.scrape_claim``, SET NX PX).
    """

    def __init__(self, client: RedisClient, schema: Schema | None = None) -> None:
        self._client = client
        self._schema = schema or Schema()
        self._key = self._schema.load
        self._put = client.register_script(_PUT_IF_NEWER_LUA)
        self._ledger = RedisLedger(client, self._schema)

    @property
    def ledger(self) -> Ledger:
        return self._ledger

    @property
    def client(self) -> RedisClient:
        """The connection (shared with the index of the same deployment)."""
        return self._client

    def put(self, replica: str, load: Load) -> None:
        check_name("replica id", replica)
        with unavailable_on_connection_errors():
            args: list[str | bytes] = [
                replica,
                repr(load.ts),
                _ENCODER.encode(load),
                answers_field(replica),
            ]
            self._put(keys=[self._key], args=args)

    def get_many(self, replicas: Sequence[str]) -> dict[str, Load]:
        wanted = list(dict.fromkeys(replicas))
        if not wanted:
            return {}
        with unavailable_on_connection_errors():
            values = self._client.hmget(self._key, wanted)
        loads = {r: _decode(r, v) for r, v in zip(wanted, values, strict=True) if v is not None}
        return {r: load for r, load in loads.items() if load is not None}

    def get_counted(
        self, replicas: Sequence[str], answers: Sequence[str] = ()
    ) -> dict[str, CountedLoad]:
        wanted = list(dict.fromkeys(replicas))
        fields = [f for r in wanted for f in (r, answers_field(r))]
        with unavailable_on_connection_errors(), self._client.pipeline(False) as pipe:
            for replica in answers:
                pipe.hincrby(self._key, answers_field(replica), 1)
            if fields:
                pipe.hmget(self._key, fields)
                self._ledger.queue_read(pipe, wanted)
            # An unreadable count (not an integer) fails its HINCRBY alone; it reads as 0
            # until the replica's next load replaces it.
            replies = pipe.execute(raise_on_error=False) if answers or fields else []
        if not fields:
            return {}
        if isinstance(replies[-2], redis.RedisError):
            raise replies[-2]
        in_flight = self._ledger.read_reply(replies[-1], wanted)
        values = cast("list[bytes | None]", replies[-2])
        out: dict[str, CountedLoad] = {}
        for i, replica in enumerate(wanted):
            value, count = values[2 * i], values[2 * i + 1]
            load = None if value is None else _decode(replica, value)
            flying = in_flight.get(replica, NO_IN_FLIGHT)
            if load is not None or flying.num_requests:
                out[replica] = CountedLoad(load, _parse_count(count), flying)
        return out

    def claim_scrapes(self, replicas: Sequence[str], hold_s: float) -> set[str]:
        wanted = list(dict.fromkeys(replicas))
        if not wanted:
            return set()
        hold_ms = max(1, round(hold_s * 1000))
        with unavailable_on_connection_errors(), self._client.pipeline(False) as pipe:
            for replica in wanted:
                pipe.set(self._schema.scrape_claim(replica), b"1", nx=True, px=hold_ms)
            won = pipe.execute()
        return {replica for replica, ok in zip(wanted, won, strict=True) if ok}

    def remove(self, replica: str) -> None:
        with unavailable_on_connection_errors():
            self._client.hdel(self._key, replica, answers_field(replica))

    def close(self) -> None:
        self._client.close()


class CircuitLoadStore:
    """A :class:`LoadStore` whose every call goes through a
    :class:`~kvindex.indexer.circuit.StoreCircuit` (a skipped call raises
    ``StoreSkippedError``, an ``IndexUnavailableError``)."""

    def __init__(self, inner: LoadStore, circuit: StoreCircuit) -> None:
        self._inner = inner
        self._circuit = circuit
        self._ledger = CircuitLedger(inner.ledger, circuit)

    @property
    def ledger(self) -> Ledger:
        return self._ledger

    def put(self, replica: str, load: Load) -> None:
        self._circuit.call(self._inner.put, replica, load)

    def get_many(self, replicas: Sequence[str]) -> dict[str, Load]:
        return self._circuit.call(self._inner.get_many, replicas)

    def get_counted(
        self, replicas: Sequence[str], answers: Sequence[str] = ()
    ) -> dict[str, CountedLoad]:
        return self._circuit.call(self._inner.get_counted, replicas, answers)

    def claim_scrapes(self, replicas: Sequence[str], hold_s: float) -> set[str]:
        return self._circuit.call(self._inner.claim_scrapes, replicas, hold_s)

    def remove(self, replica: str) -> None:
        self._circuit.call(self._inner.remove, replica)

    def close(self) -> None:
        self._inner.close()


def _parse_count(raw: bytes | None) -> int:
    """A stored answer count; 0 when absent or unreadable."""
    try:
        return max(int(raw), 0) if raw is not None else 0
    except ValueError:
        return 0


def _decode(replica: str, raw: bytes | str) -> Load | None:
    try:
        return _DECODER.decode(raw)
    except (msgspec.DecodeError, LoadError) as exc:
        logger.warning("ignoring the undecodable stored load of %s: %s", replica, exc)
        return None
