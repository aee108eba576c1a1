"""Where load is kept (:class:`LoadStore`): in process, or in Redis read as the changes since
this process's snapshot (:class:`_Fleet`), from a change log beside the load hash."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import msgspec

from kvindex.api.load.model import (
    CountedLoad,
    InFlight,
    Load,
    LoadError,
    is_newer_or_same,
)
from kvindex.api.load.reservations import (
    CircuitLedger,
    Ledger,
    MemoryLedger,
    RedisLedger,
    unavailable_on_connection_errors,
)
from kvindex.indexer.index.circuit import StoreCircuit
from kvindex.indexer.index.protocol import IndexUnavailableError
from kvindex.indexer.redis.lua import lua_script
from kvindex.indexer.redis.schema import (
    ANSWERS_SUFFIX,
    MAX_LOAD_TOMBSTONES,
    Schema,
    check_name,
)

if TYPE_CHECKING:  # the Redis client is imported where used: not by a memory-store process
    from kvindex.indexer.redis.connection import RedisClient

logger = logging.getLogger(__name__)


class LoadStore(Protocol):
    """The latest load of each replica, and the answers that chose it since; thread-safe."""

    def put(self, replica: str, load: Load) -> None:
        """Keep ``load`` unless the stored one is newer (:func:`is_newer_or_same`), atomically.
        Raises ``SchemaError`` for a replica id unusable in a Redis key."""
        ...

    def get_many(self, replicas: Sequence[str]) -> dict[str, Load]:
        """The stored load of each replica; replicas without one are absent."""
        ...

    def get_counted(
        self, replicas: Sequence[str], answers: Sequence[str] = ()
    ) -> dict[str, CountedLoad]:
        """Count ``answers`` (the replica each chose), then read each replica's load, the answers
        since it was stored (a newer ``ts`` starts at 0) and its requests in flight; replicas with
        neither are absent. Sees every change that returned before the call, in any process."""
        ...

    @property
    def ledger(self) -> Ledger:
        """The requests in flight that proxies reserved in this store."""
        ...

    def claim_scrapes(self, replicas: Sequence[str], hold_s: float) -> set[str]:
        """The replicas no other caller claimed in the last ``hold_s`` seconds: to scrape now."""
        ...

    def remove(self, replica: str) -> None:
        """Forget the replica's load and answers (a no-op for an unknown replica)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class LoadChanges(Protocol):
    """Which replicas' reads may differ since a version of the snapshot; no I/O, thread-safe."""

    def change_version(self) -> int:
        """The snapshot's version (it only grows): read it before the ``get_counted`` to follow."""
        ...

    def changed_since(self, version: int) -> list[str] | None:
        """Replicas whose ``get_counted`` entry may differ since ``version`` (None: unknown)."""
        ...


_MAX_VIEWS = 8  # replica lists whose view _Fleet keeps up to date (one per model asked about)


class _Fleet:
    """Every replica's load, count and ``CountedLoad``, and views of lists read, kept current."""

    def __init__(self) -> None:
        self.loads: dict[str, Load] = {}
        self.counts: dict[str, int] = {}  # answers since the load was stored (or no load)
        self._counted: dict[str, CountedLoad] = {}  # replicas with a load; none in flight
        self._views: dict[tuple[str, ...], tuple[frozenset[str], dict[str, CountedLoad]]] = {}
        self.version = 0
        self._cleared = 0  # the version of the last clear(): what came before is unknown
        # replica -> version of its last change, in change order (read from the end)
        self._changed: dict[str, int] = {}
        self._in_flight: Mapping[str, InFlight] = {}  # the ledger's totals the last read gave

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
    """This process's snapshot of the fleet's loads under one lock (:class:`LoadChanges`)."""

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
    """In-process :class:`LoadStore` (one API process)."""

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
        pass  # nothing to release


def _script(name: str) -> str:
    return lua_script(__name__, name, after=("load_log.lua",))


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Load)
_ANSWERS_SUFFIX = ANSWERS_SUFFIX.encode()


class RedisLoadStore(_Snapshotted):
    """Shared :class:`LoadStore` on the ``{load}`` keys of :class:`Schema`, changed only by its
    scripts; raises :class:`IndexUnavailableError` when Redis cannot be reached."""

    def __init__(self, client: RedisClient, schema: Schema | None = None) -> None:
        self._client = client
        self._schema = schema or Schema()
        self._key = self._schema.load
        self._keys = [self._key, self._schema.load_changes, self._schema.load_removed]
        from redis.crc import key_slot  # noqa: PLC0415 (see unavailable_on_connection_errors)

        self._slot = key_slot(self._key.encode())  # every load key's (one hash tag)
        self._token = uuid.uuid4().hex[:12]  # this process's part of a log's epoch
        self._put = client.register_script(_script("load_put.lua"))
        self._remove = client.register_script(_script("load_remove.lua"))
        self._read = client.register_script(_script("load_read.lua"))
        self._ledger = RedisLedger(client, self._schema)
        super().__init__()
        self._epoch = b""  # the log the snapshot follows (b"": none yet, or forgotten)
        self._seq = 0  # the last change the snapshot holds

    @property
    def ledger(self) -> Ledger:
        return self._ledger

    @property
    def client(self) -> RedisClient:
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
        from redis.cluster import RedisCluster  # noqa: PLC0415
        from redis.exceptions import NoScriptError  # noqa: PLC0415

        route: dict[str, Any] = {}
        if isinstance(self._client, RedisCluster):
            route = {"target_nodes": self._client.nodes_manager.get_node_from_slot(self._slot)}
        with unavailable_on_connection_errors():
            with self._client.pipeline(False) as pipe:
                # A raw EVALSHA (as RedisLedger.queue_read says why), addressed on a cluster.
                pipe.execute_command("EVALSHA", self._read.sha, 3, *self._keys, *args, **route)
                self._ledger.queue_read(pipe)
                reply, totals = pipe.execute(raise_on_error=False)
            if isinstance(reply, NoScriptError):  # it did not run: run it
                reply = self._read(keys=self._keys, args=args)
            elif isinstance(reply, Exception):
                raise reply
            return reply, self._ledger.read_reply(totals)

    def _apply(self, reply: Any, known: int) -> None:
        """Apply a read's reply made from seq ``known``, unless the snapshot is newer."""
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
    """A :class:`LoadStore` whose every call goes through a ``StoreCircuit``."""

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
        # the inner store's (0 when it keeps none): no I/O, so not through the circuit
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
