"""Sharded indexers: leases in Redis, and which indexer owns which stream.

Each process renews a lease (its token in one ZSET, scored by expiry on the server's clock)
every ``lease_ttl_s / 3``; one that ran out is never renewed (its holder joins again under a
new token, keeping none of its streams). A stream belongs to the live member of highest
rendezvous weight, so all agree and a join or leave moves only its share. A new owner claims a
stream in the store (while its lease runs) before reading its watermark, and every batch
script checks the token: a previous owner's batch is refused whole (``FencedError``). At each
renew the claims are read back (:meth:`Shard.lost_claims`): one taken since by an owner whose
view lagged a join is let go, and claimed again once the views agree."""

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
from kvindex.indexer.index.protocol import FencedError, IndexUnavailableError
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


def new_token(member_id: str) -> str:
    return f"{member_id}{TOKEN_SEPARATOR}{secrets.token_hex(4)}"


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
        self.token = new_token(member_id)
        self.epoch = 0
        """Joins so far: a change means a new token, and nothing of the old one's kept."""
        self.expiry_ms = 0
        """The lease's expiry on the server's clock, as of the last renew."""
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
        """Extend this lease (or remove it: ``leave``); returns the live members' ids. A
        lease that ran out is not extended: a new token joins (``epoch`` moves on).
        Raises :class:`IndexUnavailableError` when Redis is down."""
        mode = "leave" if leave else ("renew" if self.epoch else "join")
        held, tokens = self._call(mode)
        if mode == "renew" and not held:
            log.warning(
                "indexer lease %s ran out (this process paused or cut off, or redis lost "
                "it): joining again as a new member; its streams are claimed afresh",
                self.token,
            )
            self.token = new_token(self.member_id)
            self._namesakes.clear()
            mode = "join"
            held, tokens = self._call(mode)
        if mode == "join":
            self.epoch += 1
        members = tuple(sorted({member_of(t) for t in tokens}))
        if leave:
            return members  # this process is going: its view no longer matters
        if members != self.members:
            log.info("indexers live: %s (this one: %s)", ", ".join(members), self.member_id)
        self.members = members
        self._check_namesakes(tokens)
        return members

    def _call(self, mode: str) -> tuple[bool, list[str]]:
        args: list[str | int] = [self.token, int(self._ttl_s * 1000), mode]
        with unavailable_on_connection_errors():
            reply = cast("list[int | bytes]", self._renew(keys=[self._key], args=args))
        held, expiry = int(reply[0]), int(reply[1])
        if held:
            self.expiry_ms = expiry
        return bool(held), [cast("bytes", t).decode() for t in reply[2:]]

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
    path's circuit if given). One thread."""

    def __init__(
        self, membership: Membership, index: RedisIndex, circuit: StoreCircuit | None = None
    ) -> None:
        self.membership = membership
        self._index = index
        self._circuit = circuit
        client = index.client
        self._leases, self._owners = index.schema.indexers, index.schema.stream_owners
        self._claim_stream = client.register_script(lua_script(__name__, "claim_stream.lua"))
        self._claim_fence = client.register_script(lua_script(__name__, "claim_fence.lua"))
        self._epoch = membership.epoch
        self._rejoined = False

    @property
    def member_id(self) -> str:
        return self.membership.member_id

    @property
    def token(self) -> str:
        return self.membership.token

    def tick(self) -> bool:
        renewed = self.membership.tick()
        if self.membership.epoch != self._epoch:
            self._epoch = self.membership.epoch
            self._index.fence_with(self.membership.token)
            self._rejoined = self._epoch > 1
        return renewed

    def take_rejoined(self) -> bool:
        """True once after this process joined again under a new token (its lease ran
        out): every stream it kept must be dropped and claimed afresh."""
        rejoined, self._rejoined = self._rejoined, False
        return rejoined

    def owns(self, stream: StreamId) -> bool:
        return self.membership.owns(stream)

    def claim(self, stream: StreamId) -> None:
        """Record the stream as this lease's, then take its index fence; raises
        :class:`FencedError` (nothing written after) once the lease has run out."""
        if self._circuit is None:
            self._claim(stream)
        else:
            self._circuit.call(self._claim, stream)

    def _claim(self, stream: StreamId) -> None:
        token = self.membership.token
        with unavailable_on_connection_errors():
            keys = [self._leases, self._owners]
            if not self._claim_stream(keys=keys, args=[token, str(stream)]):
                raise FencedError(f"stream {stream}: not claimed, the lease ran out")
            meta = self._index.schema.stream(stream).meta
            if not self._claim_fence(keys=[meta], args=[token, self.membership.expiry_ms]):
                raise FencedError(f"stream {stream}: not fenced, the lease ran out")

    def lost_claims(self, streams: Sequence[StreamId]) -> list[StreamId]:
        """Of ``streams`` (claimed under this lease), those another token claimed since: an
        owner whose view lagged a join can claim after the joiner. [] when Redis is down."""
        if not streams:
            return []
        names = [str(stream) for stream in streams]
        try:
            if self._circuit is None:
                claims = self._claims(names)
            else:
                claims = self._circuit.call_if_closed(self._claims, names)
        except IndexUnavailableError:
            return []
        token = self.membership.token.encode()
        return [s for s, c in zip(streams, claims, strict=True) if c not in (None, token)]

    def _claims(self, names: list[str]) -> list[bytes | None]:
        with unavailable_on_connection_errors():
            return cast("list[bytes | None]", self._index.client.hmget(self._owners, names))

    def leave(self) -> None:
        self.membership.leave()
