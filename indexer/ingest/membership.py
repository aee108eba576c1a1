"""Sharded indexers: leases in Redis, and which indexer owns which stream.

Each process renews a lease (its token in one ZSET, scored by expiry) every ``lease_ttl_s /
3``. A stream belongs to the live member of highest rendezvous weight, so every member
computes the same owner and a join or leave moves only its share. Ownership is enforced in
the store: a new owner claims a stream (its token in the stream's meta) before reading its
watermark, and every batch script checks the token, so a previous owner's batch is refused
whole (``FencedError``): never two writers on one stream.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from typing import cast

import redis
import xxhash

from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.index.circuit import StoreCircuit
from kvindex.indexer.index.protocol import IndexUnavailableError
from kvindex.indexer.index.redis import RedisIndex, unavailable_on_connection_errors
from kvindex.indexer.redis.connection import RedisClient
from kvindex.indexer.redis.lua import lua_script
from kvindex.indexer.redis.schema import Schema, check_name

log = logging.getLogger("kvindex.membership")

TOKEN_SEPARATOR = "#"


def weight(member: str, key: str) -> int:
    return xxhash.xxh3_64_intdigest(f"{member}\x00{key}".encode())


def rendezvous_owner(key: str, members: Iterable[str]) -> str | None:
    best: tuple[int, str] | None = None
    for member in members:
        candidate = (weight(member, key), member)
        if best is None or candidate > best:
            best = candidate
    return None if best is None else best[1]


def member_of(token: str) -> str:
    return token.rpartition(TOKEN_SEPARATOR)[0] or token


class Membership:
    """This process's lease and its view of the live members. One thread; :attr:`members`
    may be read from any."""

    def __init__(
        self,
        client: RedisClient,
        schema: Schema,
        member_id: str,
        *,
        lease_ttl_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.member_id = check_name("indexer_id", member_id)
        self.token = f"{member_id}{TOKEN_SEPARATOR}{secrets.token_hex(4)}"
        self._client = client
        self._key = schema.indexers
        self._ttl_s = lease_ttl_s
        self._clock = clock
        self._renew = client.register_script(lua_script(__name__, "renew_lease.lua"))
        self._next_renew = float("-inf")
        self._failing = False
        self._namesakes: dict[str, float] = {}
        self._reported: set[str] = set()
        self.members: tuple[str, ...] = ()

    @property
    def renew_period_s(self) -> float:
        return self._ttl_s / 3

    def due(self) -> bool:
        return self._clock() >= self._next_renew

    def tick(self) -> bool:
        if not self.due():
            return False
        self._next_renew = self._clock() + self.renew_period_s
        try:
            self.renew()
        except IndexUnavailableError as exc:
            if not self._failing:
                log.warning("indexer lease not renewed (redis unreachable): %s", exc)
            self._failing = True
            return False
        if self._failing:
            log.info("indexer lease renewed again")
        self._failing = False
        return True

    def renew(self, *, leave: bool = False) -> tuple[str, ...]:
        """Extend this lease (or remove it: ``leave``); returns the live members' ids.
        Raises :class:`IndexUnavailableError` when Redis is down."""
        now_ms, ttl_ms = int(self._clock() * 1000), int(self._ttl_s * 1000)
        args: list[str | int] = [self.token, now_ms, ttl_ms, int(leave)]
        with unavailable_on_connection_errors():
            reply = cast("list[bytes]", self._renew(keys=[self._key], args=args))
        tokens = [t.decode() for t in reply]
        members = tuple(sorted({member_of(t) for t in tokens}))
        if leave:
            return members  # this process is going: its view no longer matters
        if members != self.members:
            log.info("indexers live: %s (this one: %s)", ", ".join(members), self.member_id)
        self.members = members
        self._check_namesakes(tokens)
        return members

    def _check_namesakes(self, tokens: Sequence[str]) -> None:
        """A lease under this id still live past ``lease_ttl_s`` is a second indexer with
        the same ``indexer_id`` (not a predecessor): logged once."""
        now = self._clock()
        others = {t for t in tokens if member_of(t) == self.member_id and t != self.token}
        self._namesakes = {t: self._namesakes.get(t, now) for t in others}
        for token, since in self._namesakes.items():
            if now - since > self._ttl_s and token not in self._reported:
                self._reported.add(token)
                log.error(
                    "another indexer renews a lease under this indexer_id %r (%s): give "
                    "each indexer its own indexer_id",
                    self.member_id,
                    token,
                )

    def leave(self) -> None:
        try:
            self.renew(leave=True)
        except (IndexUnavailableError, redis.RedisError) as exc:
            log.warning("indexer lease not removed (it expires in lease_ttl_s): %s", exc)

    def owner_of(self, stream: StreamId) -> str | None:
        return rendezvous_owner(str(stream), self.members)

    def owns(self, stream: StreamId) -> bool:
        return self.owner_of(stream) == self.member_id


class Shard:
    """What the subscriber asks about ownership: the view, and claims (through the write
    path's circuit if given)."""

    def __init__(
        self, membership: Membership, index: RedisIndex, circuit: StoreCircuit | None = None
    ) -> None:
        self.membership = membership
        self._index = index
        self._circuit = circuit

    @property
    def member_id(self) -> str:
        return self.membership.member_id

    @property
    def token(self) -> str:
        return self.membership.token

    def tick(self) -> bool:
        return self.membership.tick()

    def owns(self, stream: StreamId) -> bool:
        return self.membership.owns(stream)

    def claim(self, stream: StreamId) -> None:
        if self._circuit is None:
            self._index.claim(stream)
        else:
            self._circuit.call(self._index.claim, stream)

    def leave(self) -> None:
        self.membership.leave()
