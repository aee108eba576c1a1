"""Requests in flight, reserved by the proxies that sent them until the last byte, in a
:class:`Ledger` under a per-proxy lease (on Redis' clock there) so a dead proxy leaks nothing."""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from kvindex.api.load.model import InFlight
from kvindex.api.loop.off_loop import OffLoop
from kvindex.api.loop.periodic import Periodic
from kvindex.indexer.index.circuit import StoreCircuit
from kvindex.indexer.redis.lua import lua_script
from kvindex.indexer.redis.schema import TOKENS_SUFFIX, Schema, check_name

if TYPE_CHECKING:  # the Redis client is imported where used: not by a memory-store process
    from kvindex.indexer.redis.connection import RedisClient

logger = logging.getLogger(__name__)


def unavailable_on_connection_errors() -> AbstractContextManager[None]:
    """:func:`kvindex.indexer.index.redis.unavailable_on_connection_errors`, imported at the
    first Redis call (a process on the memory store loads no Redis client)."""
    from kvindex.indexer.index.redis import unavailable_on_connection_errors as guard  # noqa: PLC0415

    return guard()


@dataclass(frozen=True, slots=True)
class Reservation:
    """One request in flight to ``replica``, reserved by one holder."""

    id: str
    replica: str
    num_tokens: int
    """Prompt tokens the replica had not cached."""


class Ledger(Protocol):
    """Every holder's reservations (one lease each) and their totals per replica; thread-safe."""

    def reserve(self, holder: str, lease_ttl_s: float, reservation: Reservation) -> bool:
        """Add ``reservation``, extend the lease; False when none was live (a new one starts)."""
        ...

    def release(self, holder: str, reservation_id: str) -> bool:
        """Take a reservation off; False when it was not held (released, or lease lapsed)."""
        ...

    def renew(self, holder: str, lease_ttl_s: float) -> bool:
        """Extend the holder's lease; False when it had none live (a new one starts)."""
        ...

    def drop(self, holder: str) -> int:
        """End the holder's lease, releasing everything in it; how many it held."""
        ...

    def in_flight(self, replicas: Sequence[str]) -> dict[str, InFlight]:
        """The totals of every live lease per replica; replicas with none are absent."""
        ...

    def totals(self) -> dict[str, InFlight]:
        """:meth:`in_flight` of every replica with a request in flight."""
        ...


class MemoryLedger:
    """In-process :class:`Ledger`; ``clock`` in seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._holder_to_lease: dict[str, _Lease] = {}
        self._totals: dict[str, list[int]] = {}  # replica -> [requests, tokens]

    def reserve(self, holder: str, lease_ttl_s: float, reservation: Reservation) -> bool:
        with self._lock:
            lease, live = self._live(holder)
            lease.expiry = self._clock() + lease_ttl_s
            lease.id_to_reservation[reservation.id] = reservation
            total = self._totals.setdefault(reservation.replica, [0, 0])
            total[0] += 1
            total[1] += reservation.num_tokens
            return live

    def release(self, holder: str, reservation_id: str) -> bool:
        with self._lock:
            self._reap()
            lease = self._holder_to_lease.get(holder)
            reservation = (
                None if lease is None else lease.id_to_reservation.pop(reservation_id, None)
            )
            if reservation is None:
                return False
            self._subtract(reservation)
            return True

    def renew(self, holder: str, lease_ttl_s: float) -> bool:
        with self._lock:
            lease, live = self._live(holder)
            lease.expiry = self._clock() + lease_ttl_s
            return live

    def drop(self, holder: str) -> int:
        with self._lock:
            return self._drop(holder)

    def in_flight(self, replicas: Sequence[str]) -> dict[str, InFlight]:
        wanted = set(replicas)
        return {r: flying for r, flying in self.totals().items() if r in wanted}

    def totals(self) -> dict[str, InFlight]:
        with self._lock:
            self._reap()
            return {r: InFlight(*total) for r, total in self._totals.items()}

    def _live(self, holder: str) -> tuple[_Lease, bool]:
        self._reap()
        lease = self._holder_to_lease.get(holder)
        if lease is not None:
            return lease, True
        lease = self._holder_to_lease[holder] = _Lease(0.0)
        return lease, False

    def _reap(self) -> None:
        now = self._clock()
        for holder in [h for h, lease in self._holder_to_lease.items() if lease.expiry <= now]:
            self._drop(holder)

    def _drop(self, holder: str) -> int:
        lease = self._holder_to_lease.pop(holder, None)
        if lease is None:
            return 0
        for reservation in lease.id_to_reservation.values():
            self._subtract(reservation)
        return len(lease.id_to_reservation)

    def _subtract(self, reservation: Reservation) -> None:
        total = self._totals[reservation.replica]
        total[0] -= 1
        total[1] -= reservation.num_tokens
        if total[0] <= 0:
            del self._totals[reservation.replica]


@dataclass(slots=True)
class _Lease:
    expiry: float
    id_to_reservation: dict[str, Reservation] = field(default_factory=dict)


_MAX_REAP_ROUNDS = 4  # reads that may each find lapsed leases before one reads as they are


class RedisLedger:
    """Shared :class:`Ledger` on the ``{inflight}`` keys of :class:`Schema`, changed only by its
    scripts; two choices made within one round trip may each miss the other's request."""

    def __init__(self, client: RedisClient, schema: Schema | None = None) -> None:
        self._client = client
        self._schema = schema or Schema()
        self._keys = [self._schema.in_flight, self._schema.leases]
        from redis.crc import key_slot  # noqa: PLC0415 (see unavailable_on_connection_errors)

        self._slot = key_slot(self._keys[0].encode())  # every in-flight key's (one hash tag)
        self._reserve = client.register_script(_script("ledger_reserve.lua"))
        self._release = client.register_script(_script("ledger_release.lua"))
        self._renew = client.register_script(_script("ledger_renew.lua"))
        self._drop = client.register_script(_script("ledger_drop.lua"))
        self._reap = client.register_script(_script("ledger_reap.lua"))
        self._read = client.register_script(_script("ledger_read.lua"))

    def reserve(self, holder: str, lease_ttl_s: float, reservation: Reservation) -> bool:
        check_name("replica id", reservation.replica)
        args: list[str | int] = [holder, _ms(lease_ttl_s), reservation.id, reservation.replica]
        with unavailable_on_connection_errors():
            live = self._reserve(
                keys=self._holder_keys(holder), args=[*args, reservation.num_tokens]
            )
        return bool(live)

    def release(self, holder: str, reservation_id: str) -> bool:
        with unavailable_on_connection_errors():
            return bool(
                self._release(keys=self._holder_keys(holder), args=[holder, reservation_id])
            )

    def renew(self, holder: str, lease_ttl_s: float) -> bool:
        with unavailable_on_connection_errors():
            return bool(
                self._renew(keys=self._holder_keys(holder), args=[holder, _ms(lease_ttl_s)])
            )

    def drop(self, holder: str) -> int:
        with unavailable_on_connection_errors():
            return int(cast("int", self._drop(keys=self._holder_keys(holder), args=[holder])))

    def in_flight(self, replicas: Sequence[str]) -> dict[str, InFlight]:
        wanted = set(replicas)
        if not wanted:
            return {}
        return {r: flying for r, flying in self.totals().items() if r in wanted}

    def totals(self) -> dict[str, InFlight]:
        with unavailable_on_connection_errors():
            return self._read_totals(None)

    def queue_read(self, pipe: Any) -> None:
        """Queue the read of :meth:`totals` in ``pipe``; its reply goes to :meth:`read_reply`."""
        # A raw EVALSHA: redis-py's cluster pipeline refuses evalsha; on a cluster it names
        # the master of the {inflight} slot (else redis-py would ask a node for the keys).
        from redis.cluster import RedisCluster  # noqa: PLC0415

        route: dict[str, Any] = {}
        if isinstance(self._client, RedisCluster):
            node = self._client.nodes_manager.get_node_from_slot(self._slot)
            route = {"target_nodes": node}
        pipe.execute_command("EVALSHA", self._read.sha, 2, *self._keys, **route)

    def read_reply(self, reply: Any) -> dict[str, InFlight]:
        from redis.exceptions import NoScriptError  # noqa: PLC0415

        with unavailable_on_connection_errors():
            if isinstance(reply, NoScriptError):
                return self._read_totals(None)
            if isinstance(reply, Exception):
                raise reply
            return self._read_totals(reply)

    def _read_totals(self, reply: Any) -> dict[str, InFlight]:
        for _ in range(_MAX_REAP_ROUNDS):
            if reply is None:
                reply = self._read(keys=self._keys)
            status, values = reply
            if status == 1:
                return _totals(values)
            lapsed = [h.decode() if isinstance(h, bytes) else str(h) for h in values]
            keys = [*self._keys, *(self._schema.lease(h) for h in lapsed)]
            self._reap(keys=keys, args=lapsed)
            reply = None
        logger.warning("leases keep lapsing faster than they are reaped; reading as they are")
        return {}

    def _holder_keys(self, holder: str) -> list[str]:
        return [*self._keys, self._schema.lease(holder)]


def _script(name: str) -> str:
    return lua_script(__name__, name, after=("ledger_prelude.lua",))


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


_TOKENS_SUFFIX = TOKENS_SUFFIX.encode()


def _totals(flat: Sequence[bytes]) -> dict[str, InFlight]:
    requests: dict[bytes, bytes] = {}
    tokens: dict[bytes, bytes] = {}
    for i in range(0, len(flat), 2):
        field, value = flat[i], flat[i + 1]
        if field.endswith(_TOKENS_SUFFIX):
            tokens[field[: -len(_TOKENS_SUFFIX)]] = value
        else:
            requests[field] = value
    out: dict[str, InFlight] = {}
    for replica, raw in requests.items():
        num_requests = _count(raw)
        if num_requests > 0:
            out[replica.decode()] = InFlight(num_requests, _count(tokens.get(replica, b"")))
    return out


def _count(raw: bytes | str) -> int:
    try:
        return max(int(raw), 0) if raw else 0
    except ValueError:
        return 0


class CircuitLedger:
    """A :class:`Ledger` whose every call goes through a ``StoreCircuit``."""

    def __init__(self, inner: Ledger, circuit: StoreCircuit) -> None:
        self._inner = inner
        self._circuit = circuit

    def reserve(self, holder: str, lease_ttl_s: float, reservation: Reservation) -> bool:
        return self._circuit.call(self._inner.reserve, holder, lease_ttl_s, reservation)

    def release(self, holder: str, reservation_id: str) -> bool:
        return self._circuit.call(self._inner.release, holder, reservation_id)

    def renew(self, holder: str, lease_ttl_s: float) -> bool:
        return self._circuit.call(self._inner.renew, holder, lease_ttl_s)

    def drop(self, holder: str) -> int:
        return self._circuit.call(self._inner.drop, holder)

    def in_flight(self, replicas: Sequence[str]) -> dict[str, InFlight]:
        return self._circuit.call(self._inner.in_flight, replicas)

    def totals(self) -> dict[str, InFlight]:
        return self._circuit.call(self._inner.totals)


_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)  # a worker's ids are not its parent's


def new_holder() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


class Reservations:
    """One holder's reservations under one lease of ``lease_ttl_s``; thread-safe. A lease that
    lapsed with reservations held is reported through ``on_lost`` (their count)."""

    def __init__(
        self,
        ledger: Ledger,
        lease_ttl_s: float,
        *,
        holder: str | None = None,
        on_lost: Callable[[int], None] = lambda _num: None,
    ) -> None:
        if not lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s!r}")
        self.ledger = ledger
        self.lease_ttl_s = lease_ttl_s
        self.holder = check_name("lease holder", holder or new_holder())
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._held: set[str] = set()
        self._unreleased: list[str] = []  # releases that failed: tried at each renewal

    def reserve(self, replica: str, num_tokens: int) -> Reservation:
        """Reserve one request of ``num_tokens`` uncached prompt tokens on ``replica``."""
        # 128 random bits from a generator seeded once (uuid4 reads os.urandom each call)
        reservation = Reservation(f"{_ids.getrandbits(128):032x}", replica, max(0, int(num_tokens)))
        live = self.ledger.reserve(self.holder, self.lease_ttl_s, reservation)
        num_lost = 0
        with self._lock:  # the held ids change in place: no new sets a request
            if live:
                self._held.add(reservation.id)
            else:
                num_lost, self._held = len(self._held), {reservation.id}
        if num_lost:
            self._lost(num_lost)
        return reservation

    def release(self, reservation: Reservation) -> bool:
        """Release it (False: it no longer counted); a failed one is retried at :meth:`renew`."""
        with self._lock:
            if reservation.id not in self._held:
                return False
            self._held.discard(reservation.id)
        try:
            return self.ledger.release(self.holder, reservation.id)
        except Exception:
            with self._lock:
                self._unreleased.append(reservation.id)
            raise

    def renew(self) -> bool:
        """Retry failed releases, then extend the lease; False when it had lapsed."""
        with self._lock:
            unreleased, self._unreleased = self._unreleased, []
        for number, reservation_id in enumerate(unreleased):
            try:
                self.ledger.release(self.holder, reservation_id)
            except Exception:
                with self._lock:
                    self._unreleased.extend(unreleased[number:])
                raise
        live = self.ledger.renew(self.holder, self.lease_ttl_s)
        if not live:
            with self._lock:
                lost, self._held = len(self._held), set()
            if lost:
                self._lost(lost)
        return live

    def close(self) -> int:
        """Release every reservation held and end the lease; how many were still held."""
        with self._lock:
            self._held, self._unreleased = set(), []
        return self.ledger.drop(self.holder)

    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

    def _lost(self, num: int) -> None:
        logger.warning(
            "the lease of %s lapsed with %d reservations: they no longer count as in flight",
            self.holder,
            num,
        )
        self._on_lost(num)


class LeaseKeeper:
    """Renews a :class:`Reservations` lease every third of its TTL; a failure is logged, retried."""

    def __init__(
        self,
        reservations: Reservations,
        *,
        blocking: bool,
        on_failure: Callable[[], None] = lambda: None,
    ) -> None:
        self._reservations = reservations
        self._off_loop = OffLoop(blocking)
        self._on_failure = on_failure
        self._rounds = Periodic("the lease keeper", self._renew, reservations.lease_ttl_s / 3)

    async def start(self) -> None:
        """Renew in a task on the running loop; RuntimeError when already running."""
        await self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()

    async def _renew(self) -> None:
        try:
            await self._off_loop(self._reservations.renew)
        except Exception as exc:
            logger.warning("renewing the lease of %s failed: %s", self._reservations.holder, exc)
            self._on_failure()
