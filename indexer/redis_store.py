"""The Redis :class:`~indexer.index.BlockIndex`: the shared, production store.

One Lua script per batch (``apply_batch.lua``) applies every op and moves the watermark
atomically; a retry after a dropped connection finds the watermark already moved and is a
no-op. A lookup is one pipelined round trip: one short script per stream, each stopping at
that stream's first miss (``longest_prefix.lua``). Key names live in ``redis_schema``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from importlib import resources
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from indexer.events import StreamId, Tier
from indexer.index import SKIPPED, ApplyResult, Op, PrefixMatch, StreamStats
from indexer.redis_schema import (
    META_TIER_PREFIX,
    META_TS,
    META_WATERMARK,
    Schema,
    check_name,
)

_OP = struct.Struct(">BBQQ")
_TIER_OF_BYTE = tuple(Tier)


def _script(name: str) -> str:
    return resources.files("indexer").joinpath(name).read_text("utf-8")


def connect(url: str, *, socket_timeout_s: float = 5.0) -> redis.Redis:
    """A client that retries idempotent calls across a dropped connection."""
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=30,
    )


def encode_ops(ops: Sequence[Op]) -> bytes:
    """Ops as the fixed 18-byte records ``apply_batch.lua`` reads."""
    if not ops:
        return b""
    flat = [field for op in ops for field in op]
    return struct.pack(">" + "BBQQ" * len(ops), *flat)


class RedisIndex:
    """Block index in Redis (standalone now; the layout is Cluster-ready)."""

    def __init__(self, client: redis.Redis, schema: Schema | None = None) -> None:
        self._client = client
        self._schema = schema or Schema()
        self._apply = client.register_script(_script("apply_batch.lua"))
        self._prefix = client.register_script(_script("longest_prefix.lua"))
        self._registered: set[StreamId] = set()

    @classmethod
    def from_url(cls, url: str, prefix: str = "kvindex") -> RedisIndex:
        return cls(connect(url), Schema(prefix))

    def apply(self, stream: StreamId, seq: int, ts: float, ops: Sequence[Op]) -> ApplyResult:
        self._register(stream)
        keys = self._schema.stream(stream)
        reply = self._apply(keys=keys.all(), args=[seq, repr(ts), encode_ops(ops)])
        applied, unknown, unresolved = (int(x) for x in reply)
        if not applied:
            return SKIPPED
        return ApplyResult(True, unknown, unresolved)

    def _register(self, stream: StreamId) -> None:
        if stream not in self._registered:
            check_name("replica id", stream.replica)
            self._client.sadd(self._schema.streams, str(stream))
            self._registered.add(stream)

    def resolve(self, stream: StreamId, engine_hashes: Sequence[int]) -> list[int | None]:
        if not engine_hashes:
            return []
        fields = [h.to_bytes(8, "big") for h in engine_hashes]
        values = self._client.hmget(self._schema.stream(stream).hashes, fields)
        return [None if v is None else int.from_bytes(v, "big") for v in values]

    def clear(self, stream: StreamId) -> None:
        keys = self._schema.stream(stream)
        with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(keys.keys, keys.hashes)
            pipe.hset(keys.meta, mapping=_empty_meta())
            pipe.hdel(keys.meta, META_TS)
            pipe.execute()

    def drop(self, stream: StreamId) -> None:
        self._client.delete(*self._schema.stream(stream).all())
        self._client.srem(self._schema.streams, str(stream))
        self._registered.discard(stream)

    def streams(self) -> list[StreamId]:
        members: set[bytes] = self._client.smembers(self._schema.streams)  # type: ignore[assignment]
        return sorted(StreamId.parse(m.decode()) for m in members)

    def longest_prefix(
        self, keys: Sequence[int], streams: Iterable[StreamId]
    ) -> dict[StreamId, PrefixMatch]:
        wanted = b"".join(k.to_bytes(8, "big") for k in keys)
        targets = list(streams)
        with self._client.pipeline(transaction=False) as pipe:
            for stream in targets:
                self._prefix(keys=[self._schema.stream(stream).keys], args=[wanted], client=pipe)
            replies: list[bytes] = pipe.execute()
        return {
            stream: PrefixMatch(tuple(_TIER_OF_BYTE[b] for b in reply))
            for stream, reply in zip(targets, replies, strict=True)
        }

    def stats(self, stream: StreamId) -> StreamStats:
        raw: dict[bytes, bytes] = self._client.hgetall(self._schema.stream(stream).meta)  # type: ignore[assignment]
        meta = {k.decode(): v.decode() for k, v in raw.items()}
        by_tier = {t: int(meta.get(f"{META_TIER_PREFIX}{t.value}", 0)) for t in Tier}
        ts = meta.get(META_TS)
        return StreamStats(
            stream,
            int(meta.get(META_WATERMARK, -1)),
            None if ts is None else float(ts),
            by_tier,
        )

    def close(self) -> None:
        self._client.close()


def _empty_meta() -> dict[str, Any]:
    meta: dict[str, Any] = {META_WATERMARK: -1}
    for tier in Tier:
        meta[f"{META_TIER_PREFIX}{tier.value}"] = 0
    return meta
