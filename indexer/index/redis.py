"""The Redis :class:`~kvindex.indexer.index.protocol.BlockIndex`: the shared, production store.

One Lua script per batch (``apply_batch.lua``) applies every op and moves the watermark
atomically; a retry after a dropped connection finds the watermark already moved and is a
no-op. A lookup is one pipelined round trip: one short script per group of streams, walking
each stream up to its first miss (``longest_prefix.lua``); on Redis Cluster, one script per
group of streams of one slot, sent to every master before any reply is read. Key names live
in ``redis_schema``.

Sharded indexers (``owner``): the batch script and ``clear_stream.lua`` first compare the
writer's lease token with the stream's ``owner`` meta field (the same hash tag: still one
slot), so a writer another indexer has claimed the stream from changes nothing
(:class:`FencedError`); one more HGET per batch, one short field per stream.

What a lookup costs: one HGET per requested stream that holds nothing, and n + 1 for a stream
matching n blocks, so it grows with the fleet (1,024 replicas, 256 of them sharing a 64-block
system prompt: about 18,000 HGETs, ~20 ms of Redis CPU). Reading a holder's prefix in HMGETs
of 1, 2, 4, ... fields was tried and cost more Redis CPU there (23-25 ms against 18-21 ms in
alternating runs on one server): a field read costs about as much as a script's call, and the
over-read doubles the fields. What would make the cost follow the match is the memory
backend's block → holders map; in Redis it costs a hash entry per (block, stream) beside the
per-stream hash (over the budget of 150 bytes per entry, today ~143) unless it replaces that
hash, and a shared key makes a batch touch a second slot (Redis Cluster runs a script on one).
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from importlib import resources
from itertools import starmap
from typing import cast

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

from kvindex.indexer.events import StreamId, Tier
from kvindex.indexer.index.protocol import (
    MAX_SEQ,
    SKIPPED,
    ApplyResult,
    BatchOps,
    FencedError,
    IndexUnavailableError,
    Op,
    PrefixMatch,
    StreamStats,
    applied,
)
from kvindex.indexer.redis_connection import (
    CLUSTER_AS_STANDALONE,
    STORE_ERRORS,
    RedisClient,
    connect,
)
from kvindex.indexer.redis_schema import (
    META_OWNER,
    META_TIER_PREFIX,
    META_TS,
    META_WATERMARK,
    Schema,
    check_name,
)

_OP = struct.Struct(">BBQQ")
_TIER_OF_BYTE = tuple(Tier)
STREAMS_PER_LOOKUP = 32
"""Streams walked by one ``longest_prefix.lua`` call. A call per stream cost more than its
reads (a 512-block prompt over 32 streams: 1.17 → 0.74 ms a lookup); the cap keeps one
call from holding Redis long when many streams match a long prompt. On Redis Cluster a
call's streams also share a slot (mostly one stream per call: a slot per stream)."""


def _script(name: str) -> str:
    return resources.files("kvindex.indexer.index").joinpath(name).read_text("utf-8")


@contextmanager
def unavailable_on_connection_errors() -> Iterator[None]:
    """Redis unreachable (after the client's own retries; on a cluster also a slot without
    a master) → :class:`IndexUnavailableError`.

    Every Redis-backed store of kvindex (index, load) reports an outage this one way."""
    try:
        yield
    except STORE_ERRORS as exc:
        raise IndexUnavailableError(f"redis: {exc}") from exc
    except redis.exceptions.AskError as exc:  # MOVED / ASK reached a standalone client
        raise IndexUnavailableError(f"redis: {CLUSTER_AS_STANDALONE} ({exc})") from exc


def _match(reply: bytes) -> PrefixMatch:
    """The script's one byte per block → tiers (fast path: all GPU)."""
    if reply.count(0) == len(reply):
        return PrefixMatch((Tier.GPU,) * len(reply))
    return PrefixMatch(tuple(_TIER_OF_BYTE[b] for b in reply))


def encode_ops(ops: Sequence[Op]) -> bytes:
    """Ops as the fixed 18-byte records ``apply_batch.lua`` reads."""
    return b"".join(starmap(_OP.pack, ops))


class RedisIndex:
    """Block index in Redis, standalone or Cluster (``redis_connection`` builds either).

    Every method raises :class:`IndexUnavailableError` when Redis cannot be reached.

    ``owner``: this writer's lease token (sharded indexers, ``kvindex.indexer.membership``).
    With it every batch and clear is fenced inside its script: a stream whose meta names
    another owner is left as it is and :class:`FencedError` raised; :meth:`claim` makes the
    token the stream's owner. Without it (one indexer per store) nothing is fenced.
    """

    def __init__(
        self, client: RedisClient, schema: Schema | None = None, *, owner: str | None = None
    ) -> None:
        self._client = client
        self._schema = schema or Schema()
        self._owner = owner
        self._apply = client.register_script(_script("apply_batch.lua"))
        self._clear = client.register_script(_script("clear_stream.lua"))
        self._prefix = client.register_script(_script("longest_prefix.lua"))
        self._registered: set[StreamId] = set()
        self._keys_of: dict[StreamId, tuple[str, str, str]] = {}
        self._slot_of: dict[StreamId, int] = {}
        self._identity: bytes | None = None
        """The marker token this index last saw (None: not looked at yet)."""

    @property
    def client(self) -> RedisClient:
        """The connection (other stores of the same deployment share it, e.g. load)."""
        return self._client

    @property
    def schema(self) -> Schema:
        """Its key names (other shared state of the deployment uses the same prefix)."""
        return self._schema

    @classmethod
    def from_url(cls, url: str, prefix: str = "kvindex") -> RedisIndex:
        return cls(connect(url), Schema(prefix))

    def apply(self, stream: StreamId, seq: int, ts: float, ops: Sequence[Op]) -> ApplyResult:
        return self.apply_many(stream, [(seq, ts, ops)])[0]

    def apply_many(self, stream: StreamId, batches: Sequence[BatchOps]) -> list[ApplyResult]:
        if not batches:
            return []
        args: list[bytes | int | str] = [len(batches)]
        for seq, ts, ops in batches:
            # The script compares seqs as decimal strings (exact below 2**64, where a Lua
            # number is not); a longer one would compare wrongly.
            assert seq < MAX_SEQ, seq
            args += (seq, repr(ts), encode_ops(ops))
        if self._owner is not None:
            args.append(self._owner)
        keys = self._keys(stream)
        with unavailable_on_connection_errors():
            self._register(stream)
            reply = self._apply(keys=keys, args=args)
            if len(reply) == 1:  # the script's fence: another indexer owns the stream
                raise FencedError(f"stream {stream}: owned by another indexer")
            if reply[-1]:
                # The stream's state was (re)created by this call: it may have been dropped
                # by another indexer or lost in a Redis restart since this process listed it.
                self._client.sadd(self._schema.streams, str(stream))
        return [
            applied(int(reply[i + 1]), int(reply[i + 2])) if reply[i] else SKIPPED
            for i in range(0, len(reply) - 1, 3)
        ]

    def _register(self, stream: StreamId) -> None:
        """List the stream before its first batch here (a crash then leaves no unlisted keys)."""
        if stream not in self._registered:
            check_name("replica id", stream.replica)
            self._client.sadd(self._schema.streams, str(stream))
            self._registered.add(stream)

    def resolve(self, stream: StreamId, engine_hashes: Sequence[int]) -> list[int | None]:
        if not engine_hashes:
            return []
        fields = [h.to_bytes(8, "big") for h in engine_hashes]
        with unavailable_on_connection_errors():
            reply = self._client.hmget(self._schema.stream(stream).hashes, fields)
        values = cast("list[bytes | None]", reply)
        return [None if v is None else int.from_bytes(v, "big") for v in values]

    def clear(self, stream: StreamId) -> None:
        # One DEL of the stream's own keys: atomic, single-slot, and it leaves nothing behind
        # for a stream never seen. An absent meta reads as watermark -1 and no blocks.
        # Fenced: the same in a script that first checks the owner and keeps it.
        with unavailable_on_connection_errors():
            if self._owner is None:
                self._client.delete(*self._schema.stream(stream).all())
            elif not self._clear(keys=self._keys(stream), args=[self._owner]):
                raise FencedError(f"stream {stream}: owned by another indexer")

    def claim(self, stream: StreamId) -> None:
        """Make this writer's token the stream's owner (one HSET on its meta): the previous
        owner's next batch is fenced out. Call it before reading the watermark to resume
        from (:meth:`stats`), so nothing the previous owner applied is missed."""
        if self._owner is None:
            return
        with unavailable_on_connection_errors():
            self._client.hset(self._keys(stream)[0], META_OWNER, self._owner)

    def owner(self, stream: StreamId) -> str | None:
        """The lease token that owns the stream (None: no owner recorded)."""
        with unavailable_on_connection_errors():
            raw = cast("bytes | None", self._client.hget(self._keys(stream)[0], META_OWNER))
        return None if raw is None else raw.decode()

    def drop(self, stream: StreamId) -> None:
        with unavailable_on_connection_errors():
            self._client.delete(*self._schema.stream(stream).all())
            self._client.srem(self._schema.streams, str(stream))
        self._registered.discard(stream)

    def streams(self) -> list[StreamId]:
        with unavailable_on_connection_errors():
            reply = self._client.smembers(self._schema.streams)
        members = cast("set[bytes]", reply)
        return sorted(StreamId.parse(m.decode()) for m in members)

    def longest_prefix(
        self, keys: Sequence[int], streams: Iterable[StreamId]
    ) -> dict[StreamId, PrefixMatch]:
        # Whole keys, big-endian: one C call; the script reads each one's field (low 6 bytes).
        wanted = struct.pack(f">{len(keys)}Q", *keys)
        groups = self._groups(list(streams))
        with unavailable_on_connection_errors():
            try:
                replies = self._prefix_pipeline(groups, wanted)
            except redis.exceptions.NoScriptError:  # Redis restarted or flushed its scripts
                self._client.script_load(self._prefix.script)  # on a cluster: every master
                replies = self._prefix_pipeline(groups, wanted)
        targets = [stream for group in groups for stream in group]
        return {stream: _match(reply) for stream, reply in zip(targets, replies, strict=True)}

    def _groups(self, targets: list[StreamId]) -> list[list[StreamId]]:
        """The streams of one script call each: at most :data:`STREAMS_PER_LOOKUP`, and on
        a cluster all in one slot (a script's keys must be; one stream per slot, mostly)."""
        size = STREAMS_PER_LOOKUP
        if not isinstance(self._client, RedisCluster):
            return [targets[i : i + size] for i in range(0, len(targets), size)]
        slot_to_streams: dict[int, list[StreamId]] = {}
        for stream in targets:
            slot_to_streams.setdefault(self._slot(stream), []).append(stream)
        return [
            same[i : i + size]
            for same in slot_to_streams.values()
            for i in range(0, len(same), size)
        ]

    def _prefix_pipeline(self, groups: list[list[StreamId]], wanted: bytes) -> list[bytes]:
        """One round trip (on a cluster, one per master, all sent before any is read): an
        EVALSHA per group of streams. Sent as a raw command: redis-py's Script would add
        SCRIPT EXISTS in a pipeline, and its cluster pipeline refuses ``evalsha``; on a
        cluster each names its master, else redis-py would ask a node for the command's
        keys (COMMAND GETKEYS) one round trip at a time."""
        with self._client.pipeline(transaction=False) as pipe:
            for group in groups:
                names = [self._keys(stream)[1] for stream in group]
                route = self._route(group[0])
                pipe.execute_command(
                    "EVALSHA", self._prefix.sha, len(names), *names, wanted, **route
                )
            replies = cast("list[list[bytes]]", pipe.execute())
        return [reply for group_replies in replies for reply in group_replies]

    def _route(self, stream: StreamId) -> dict[str, ClusterNode]:
        """On a cluster, the pipeline option naming the master of the stream's slot."""
        if not isinstance(self._client, RedisCluster):
            return {}
        return {"target_nodes": self._client.nodes_manager.get_node_from_slot(self._slot(stream))}

    def _slot(self, stream: StreamId) -> int:
        """The cluster slot of a stream's keys (they share its hash tag), computed once."""
        slot = self._slot_of.get(stream)
        if slot is None:
            slot = self._slot_of[stream] = key_slot(self._keys(stream)[1].encode())
        return slot

    def _keys(self, stream: StreamId) -> tuple[str, str, str]:
        """(meta, keys, hash) names of a stream, computed once."""
        keys = self._keys_of.get(stream)
        if keys is None:
            keys = self._keys_of[stream] = self._schema.stream(stream).all()
        return keys

    def stats(self, stream: StreamId) -> StreamStats:
        with unavailable_on_connection_errors():
            reply = self._client.hgetall(self._schema.stream(stream).meta)
        raw = cast("dict[bytes, bytes]", reply)
        meta = {k.decode(): v.decode() for k, v in raw.items()}
        by_tier = {t: int(meta.get(f"{META_TIER_PREFIX}{t.value}", 0)) for t in Tier}
        ts = meta.get(META_TS)
        return StreamStats(
            stream,
            _watermark(meta.get(META_WATERMARK)),
            None if ts is None else float(ts),
            by_tier,
        )

    def intact(self) -> bool:
        """The marker key holds the token seen last time: one GET. Absent (the data was
        lost), a new token is set unless another process set one first, and adopted; a
        token that changed means another process saw the loss first."""
        marker = self._schema.index_marker
        with unavailable_on_connection_errors():
            token = cast("bytes | None", self._client.get(marker))
            if token is not None and token == self._identity:
                return True
            if token is None:
                self._client.set(marker, secrets.token_hex(8), nx=True)
                token = cast("bytes | None", self._client.get(marker))
        first = self._identity is None
        self._identity = token
        if not first:
            self._registered.clear()  # the streams SET was lost too: list them again
        return first

    def close(self) -> None:
        self._client.close()


def _watermark(stored: str | None) -> int:
    """The stored watermark as an exact int; -1 when absent or not a decimal integer (a
    float such as ``3e+18`` written before seqs were compared as strings: the script treats
    it the same way and overwrites it with the next batch)."""
    if stored is None or not (stored.isascii() and stored.isdigit()) or len(stored) > 20:
        return -1
    return int(stored)
