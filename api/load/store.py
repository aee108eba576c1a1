"""Where load is kept: the :class:`LoadStore` Protocol, in-process and in Redis.

Both stores keep the newest load per replica (:func:`~kvindex.api.load.model.is_newer_or_same`)
and count the answers that chose it since; each owns the ledger of the requests in flight
that proxies reserve in it (:mod:`~kvindex.api.load.reservations`) and reads its totals
with the loads. ``tests/contract/test_load_contract.py`` and
``tests/contract/test_reservation_contract.py`` run one suite against both.

What a read costs (``get_counted``, once per ``/score`` answer): both stores keep the fleet's
counted loads as they change (:class:`_Fleet`: one ``CountedLoad`` per replica, made when its
load or count changes, not per read), so a read is one copy of a dict plus one entry per
replica with requests in flight, whatever the fleet's size. The memory store changes it in
place. Each snapshot also says which replicas' entries changed since a version of it
(:class:`LoadChanges`: a version per change, the changed replicas read newest first, so
O(changes)), which is how the scorer keeps its penalty floors per change, not per read.
The Redis store keeps it as a snapshot of the shared hash and reads **only what changed
since its last read**, in one round trip:

* every put, answer count and removal bumps a change sequence (``#seq``, a field of the
  load hash) and records the replica under it, in the same script: a put or a count in
  the ``changes`` ZSET (replica → seq of its last change), a removal as a tombstone in the
  ``removed`` ZSET (the newest :data:`~kvindex.indexer.redis.schema.MAX_LOAD_TOMBSTONES`
  kept; ``#trimmed`` says up to which seq some were dropped);
* a read is one script: count this process's answers, then return the fields of the
  replicas changed after the reader's seq, and the tombstones after it. Answers of other
  processes and their puts are changes like any other: seen by the next read;
* the log has an identity, ``#epoch`` (a random token set by the first write to a hash
  without one, which then empties the ZSETs). A reader whose epoch differs (the hash was
  lost: FLUSHALL, a Redis restarted empty), whose seq is ahead of the store's (a Redis
  restarted on older data) or below ``#trimmed``, and one that saw Redis unreachable (it
  forgets its snapshot), reads the whole hash instead, once;
* the ledger's totals are read whole (one field per replica with requests in flight, not
  one per replica asked for), by a second script in the same pipeline (its keys are apart,
  ``{inflight}``).

Reads in several threads at once each apply their reply only when it is newer than the
snapshot (a higher seq, or a whole read of another epoch), so a late reply never replaces
a newer one.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import msgspec
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from kvindex.api.load.model import (
    CountedLoad,
    InFlight,
    Load,
    LoadError,
    is_newer_or_same,
)
from kvindex.api.load.reservations import CircuitLedger, Ledger, MemoryLedger, RedisLedger
from kvindex.indexer.index.circuit import StoreCircuit
from kvindex.indexer.index.protocol import IndexUnavailableError
from kvindex.indexer.index.redis import unavailable_on_connection_errors
from kvindex.indexer.redis.connection import RedisClient
from kvindex.indexer.redis.lua import lua_script
from kvindex.indexer.redis.schema import (
    ANSWERS_SUFFIX,
    MAX_LOAD_TOMBSTONES,
    Schema,
    check_name,
)

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

        Every put, count and removal that returned before the call (in any process sharing
        the store) is seen. The dict is the caller's own; its entries (immutable) may be
        the same objects as in other reads.
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


@runtime_checkable
class LoadChanges(Protocol):
    """Which replicas' reads may differ since a version of this process's snapshot (both
    stores keep one: :class:`_Fleet`), so that what a reader derives from the loads (the
    scorer's penalty floors) is redone for those alone. In memory, no I/O, thread-safe."""

    def change_version(self) -> int:
        """The snapshot's version now (it only grows); read it before a
        :meth:`LoadStore.get_counted` whose result is to be followed from then on."""
        ...

    def changed_since(self, version: int) -> list[str] | None:
        """Every replica whose ``get_counted`` entry (load, count or requests in flight)
        may differ from what a read made at ``version`` gave (a superset: changes up to the
        call), once each; None when that is unknown (the snapshot was emptied since, or
        ``version`` is not one it had), for the reader to start again."""
        ...


_MAX_VIEWS = 8
"""Replica lists whose view :class:`_Fleet` keeps up to date (one per model asked about)."""


class _Fleet:
    """Every replica's load and answer count, and the ``CountedLoad`` they make, kept as
    they change; not thread-safe (its store's lock guards it).

    A read names the replicas it wants; the view of each list asked for (the last
    :data:`_MAX_VIEWS`) is kept up to date too, so a read copies a dict rather than picking
    the fleet's replicas one by one.
    """

    def __init__(self) -> None:
        self.loads: dict[str, Load] = {}
        self.counts: dict[str, int] = {}
        """Per replica (with a load or not): answers that chose it since its load was stored."""
        self._counted: dict[str, CountedLoad] = {}
        """Per replica with a load: its load and count, none in flight."""
        self._views: dict[tuple[str, ...], tuple[frozenset[str], dict[str, CountedLoad]]] = {}
        self.version = 0
        """Bumped by every change of a read's entries (:meth:`changed_since`)."""
        self._cleared = 0
        """The version of the last :meth:`clear`: what came before it is unknown."""
        self._changed: dict[str, int] = {}
        """Replica -> version of its last change, in the order of those changes (a change
        moves its replica to the end), so the changes since a version are read from the end."""
        self._in_flight: Mapping[str, InFlight] = {}
        """The ledger's totals the last read gave (their changes are changes of a read)."""

    def clear(self) -> None:
        self.loads, self.counts, self._counted, self._views = {}, {}, {}, {}
        self.version += 1
        self._cleared, self._changed, self._in_flight = self.version, {}, {}

    def _note(self, replica: str) -> None:
        self.version += 1
        changed = self._changed
        changed.pop(replica, None)
        changed[replica] = self.version

    def changed_since(self, version: int) -> list[str] | None:
        """:meth:`LoadChanges.changed_since`: O(changes since), newest first."""
        if version < self._cleared or version > self.version:
            return None
        out: list[str] = []
        changed = self._changed
        for replica in reversed(changed):
            if changed[replica] <= version:
                break
            out.append(replica)
        return out

    def set(self, replica: str, load: Load | None, count: int) -> None:
        """The replica's load (None: none stored) and count, as they now are."""
        self._note(replica)
        counted = None
        if load is None:
            self.loads.pop(replica, None)
            self._counted.pop(replica, None)
        else:
            self.loads[replica] = load
            counted = self._counted[replica] = CountedLoad(load, count)
        if count:
            self.counts[replica] = count
        else:
            self.counts.pop(replica, None)
        for wanted, view in self._views.values():
            if replica in wanted:
                if counted is None:
                    view.pop(replica, None)
                else:
                    view[replica] = counted

    def read(
        self, replicas: Sequence[str], in_flight: Mapping[str, InFlight]
    ) -> dict[str, CountedLoad]:
        """A new dict: each of ``replicas`` with a load or a request in flight
        (``in_flight``: the ledger's totals, every replica with any)."""
        key = tuple(replicas)
        found = self._views.get(key)
        if found is None:
            found = self._view(key)
        wanted, view = found
        out = view.copy()
        if in_flight != self._in_flight:  # few entries: the replicas proxies reserved
            last = self._in_flight
            for replica in last.keys() | in_flight.keys():
                if last.get(replica) != in_flight.get(replica):
                    self._note(replica)
            self._in_flight = dict(in_flight)
        for replica, flying in in_flight.items():  # few: the replicas proxies reserved
            if replica in wanted:
                load, count = self.loads.get(replica), self.counts.get(replica, 0)
                out[replica] = CountedLoad(load, count, flying)
        return out

    def _view(self, key: tuple[str, ...]) -> tuple[frozenset[str], dict[str, CountedLoad]]:
        if len(self._views) >= _MAX_VIEWS:
            del self._views[next(iter(self._views))]  # the oldest list asked for
        counted = self._counted
        made = frozenset(key), {r: counted[r] for r in key if r in counted}
        self._views[key] = made
        return made


class _Snapshotted:
    """What both stores keep: this process's snapshot of the fleet's loads under one lock,
    and what changed in it (:class:`LoadChanges`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fleet = _Fleet()

    def change_version(self) -> int:
        with self._lock:
            return self._fleet.version

    def changed_since(self, version: int) -> list[str] | None:
        with self._lock:
            return self._fleet.changed_since(version)


class MemoryLoadStore(_Snapshotted):
    """In-process :class:`LoadStore` (one API process). Thread-safe (one lock)."""

    def __init__(self, ledger: MemoryLedger | None = None) -> None:
        super().__init__()
        self._ledger = ledger or MemoryLedger()

    @property
    def ledger(self) -> Ledger:
        return self._ledger

    def put(self, replica: str, load: Load) -> None:
        check_name("replica id", replica)
        with self._lock:
            fleet = self._fleet
            old = fleet.loads.get(replica)
            if is_newer_or_same(load, old):
                # The same measurement again keeps its count; a newer one starts from 0.
                same = old is not None and load.ts == old.ts
                fleet.set(replica, load, fleet.counts.get(replica, 0) if same else 0)

    def get_many(self, replicas: Sequence[str]) -> dict[str, Load]:
        with self._lock:
            loads = self._fleet.loads
            return {r: loads[r] for r in replicas if r in loads}

    def get_counted(
        self, replicas: Sequence[str], answers: Sequence[str] = ()
    ) -> dict[str, CountedLoad]:
        in_flight = self._ledger.totals()
        with self._lock:
            fleet = self._fleet
            for replica in answers:
                fleet.set(replica, fleet.loads.get(replica), fleet.counts.get(replica, 0) + 1)
            return fleet.read(replicas, in_flight)

    def claim_scrapes(self, replicas: Sequence[str], hold_s: float) -> set[str]:
        return set(replicas)

    def remove(self, replica: str) -> None:
        with self._lock:
            self._fleet.set(replica, None, 0)

    def close(self) -> None:
        """Nothing to release."""


def _script(name: str) -> str:
    return lua_script(__name__, name, after=("load_log.lua",))


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Load)
_ANSWERS_SUFFIX = ANSWERS_SUFFIX.encode()


class RedisLoadStore(_Snapshotted):
    """Shared :class:`LoadStore`: the ``{load}`` keys of :class:`Schema` (a HASH replica id →
    load as JSON, its answer counts and the change log's fields; the ``changes`` and
    ``removed`` ZSETs), and the snapshot of them this process last read (the module says
    how it stays current).

    A put and a remove are one Lua script each (compare ``ts``, then set, then log the
    change: atomic across API processes); a ``get_many`` is one HMGET; a ``get_counted`` is
    one round trip of two scripts (count the answers and read the changes; read the
    in-flight totals of its :class:`RedisLedger`, whose keys are apart: ``{inflight}``). A
    replica's answers are its field ``<replica>/answers`` of the same HASH (no replica id
    contains ``/``); the put script deletes that field when it stores a newer load. Every
    method raises :class:`IndexUnavailableError` when Redis cannot be reached. A stored
    value that cannot be decoded reads as absent (logged when read). Scrape claims are
    short-lived keys (``Schema.scrape_claim``, SET NX PX).
    """

    def __init__(self, client: RedisClient, schema: Schema | None = None) -> None:
        self._client = client
        self._schema = schema or Schema()
        self._key = self._schema.load
        self._keys = [self._key, self._schema.load_changes, self._schema.load_removed]
        self._slot = key_slot(self._key.encode())
        """The cluster slot of every load key (one hash tag)."""
        self._token = uuid.uuid4().hex[:12]
        """This process's part of the epoch of a log it opens (with the server's clock)."""
        self._put = client.register_script(_script("load_put.lua"))
        self._remove = client.register_script(_script("load_remove.lua"))
        self._read = client.register_script(_script("load_read.lua"))
        self._ledger = RedisLedger(client, self._schema)
        super().__init__()
        self._epoch = b""
        """The log the snapshot follows (b"": none yet, or forgotten)."""
        self._seq = 0
        """The last change the snapshot holds."""

    @property
    def ledger(self) -> Ledger:
        return self._ledger

    @property
    def client(self) -> RedisClient:
        """The connection (shared with the index of the same deployment)."""
        return self._client

    def put(self, replica: str, load: Load) -> None:
        check_name("replica id", replica)
        args: list[str | bytes] = [self._token, replica, repr(load.ts), _ENCODER.encode(load)]
        with unavailable_on_connection_errors():
            self._put(keys=self._keys, args=args)

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
        with self._lock:
            known = self._seq
            args: list[str | bytes | int] = [self._token, self._epoch, known, *answers]
        try:
            reply, in_flight = self._read_changes(args)
        except IndexUnavailableError:
            with self._lock:  # Redis may come back on other data: read it whole then
                self._fleet.clear()
                self._epoch, self._seq = b"", 0
            raise
        with self._lock:
            self._apply(reply, known)
            return self._fleet.read(replicas, in_flight)

    def _read_changes(self, args: list[str | bytes | int]) -> tuple[Any, dict[str, InFlight]]:
        """One round trip: the read script's reply, and the ledger's totals."""
        route: dict[str, Any] = {}
        if isinstance(self._client, RedisCluster):
            route = {"target_nodes": self._client.nodes_manager.get_node_from_slot(self._slot)}
        with unavailable_on_connection_errors():
            with self._client.pipeline(False) as pipe:
                # A raw EVALSHA (as RedisLedger.queue_read says why), addressed on a cluster.
                pipe.execute_command("EVALSHA", self._read.sha, 3, *self._keys, *args, **route)
                self._ledger.queue_read(pipe)
                reply, totals = pipe.execute(raise_on_error=False)
            if isinstance(reply, redis.exceptions.NoScriptError):  # it did not run: run it
                reply = self._read(keys=self._keys, args=args)
            elif isinstance(reply, Exception):
                raise reply
            return reply, self._ledger.read_reply(totals)

    def _apply(self, reply: Any, known: int) -> None:
        """Bring the snapshot to a reply of the read script made from seq ``known``, unless
        it is older (a reply of another thread's read that started earlier and finished
        later). A whole read below ``known`` (Redis went back to older data) replaces it."""
        epoch, seq, whole, *rest = reply
        epoch = bytes(epoch) if epoch else b""
        seq = int(seq)
        went_back = whole and seq < known
        if epoch == self._epoch and seq <= self._seq and not went_back:
            return
        if whole:
            self._fleet.clear()
            self._read_whole(cast("list[bytes]", rest[0]))
        elif epoch != self._epoch:  # changes of a log the snapshot no longer follows
            return
        else:
            self._read_delta(cast("list[bytes | None]", rest[0]), cast("list[bytes]", rest[1]))
        self._epoch, self._seq = epoch, seq

    def _read_whole(self, flat: list[bytes]) -> None:
        """The snapshot from the whole hash (HGETALL: field, value, ...)."""
        loads: dict[str, bytes] = {}
        counts: dict[str, bytes] = {}
        for i in range(0, len(flat), 2):
            field, value = flat[i], flat[i + 1]
            if field.startswith(b"#"):
                continue
            if field.endswith(_ANSWERS_SUFFIX):
                counts[field[: -len(_ANSWERS_SUFFIX)].decode()] = value
            else:
                loads[field.decode()] = value
        for replica in loads.keys() | counts.keys():
            raw = loads.get(replica)
            load = None if raw is None else _decode(replica, raw)
            self._fleet.set(replica, load, _parse_count(counts.get(replica)))

    def _read_delta(self, changed: list[bytes | None], removed: list[bytes]) -> None:
        """The changes (replica, load, count, ...) and removals since the snapshot's seq."""
        fleet = self._fleet
        for i in range(0, len(changed), 3):
            replica = cast("bytes", changed[i]).decode()
            raw, count = changed[i + 1], changed[i + 2]
            load = None if raw is None else _decode(replica, raw)
            fleet.set(replica, load, _parse_count(count))
        for name in removed:
            fleet.set(name.decode(), None, 0)

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
            self._remove(keys=self._keys, args=[self._token, replica, MAX_LOAD_TOMBSTONES])

    def close(self) -> None:
        self._client.close()


class CircuitLoadStore:
    """A :class:`LoadStore` whose every call goes through a
    :class:`~kvindex.indexer.index.circuit.StoreCircuit` (a skipped call raises
    ``StoreSkippedError``, an ``IndexUnavailableError``)."""

    def __init__(self, inner: LoadStore, circuit: StoreCircuit) -> None:
        self._inner = inner
        self._circuit = circuit
        self._ledger = CircuitLedger(inner.ledger, circuit)
        self._changes = inner if isinstance(inner, LoadChanges) else None

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

    def change_version(self) -> int:
        """The inner store's (0 when it keeps none): no I/O, so not through the circuit."""
        changes = self._changes
        return changes.change_version() if changes is not None else 0

    def changed_since(self, version: int) -> list[str] | None:
        changes = self._changes
        return changes.changed_since(version) if changes is not None else None

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
