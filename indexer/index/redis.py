"""The Redis :class:`~kvindex.indexer.index.protocol.BlockIndex`, the shared production store.

Streams fall into groups (``redis.schema``), each a hash block → its holders' records under one
hash tag. A batch is one ``apply_batch.lua`` call, atomic with the watermark and fenced by the
writer's lease when sharded; a lookup is one round trip (``longest_prefix.lua`` per group)."""

from __future__ import annotations

import secrets
import struct
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import starmap
from typing import cast

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.index.protocol import (
    MAX_SEQ,
    NO_MATCH,
    SKIPPED,
    ApplyResult,
    BatchOps,
    FencedError,
    HeldRuns,
    IndexUnavailableError,
    Op,
    PrefixMatch,
    StreamStats,
    applied,
)
from kvindex.indexer.redis.connection import (
    CLUSTER_AS_STANDALONE,
    STORE_ERRORS,
    RedisClient,
    connect,
)
from kvindex.indexer.redis.lua import lua_script
from kvindex.indexer.redis.schema import (
    CLUSTER_INDEX_GROUPS,
    INDEX_VERSION,
    META_OWNER,
    META_TIER_PREFIX,
    META_TS,
    META_WATERMARK,
    OLD_INDEX_VERSIONS,
    STANDALONE_INDEX_GROUPS,
    TOPOLOGY_INDEX_GROUPS,
    Schema,
    SchemaVersionError,
    check_name,
)

_OP = struct.Struct(">BBQQ")
_COUNTS = struct.Struct(">HHH")
_RUN_HEAD = struct.Struct(">II")
"""A run's head in ``longest_prefix.lua``'s answer: its blocks, its value's length."""
_MAX_CACHED = 1024  # group answers a lookup plan keeps decoded; beyond, it starts afresh
_TIERS = tuple(Tier)
_LONG_FORM = 3  # a holder record's form carrying its counts; forms 0-2: one block on that tier


@contextmanager
def unavailable_on_connection_errors() -> Iterator[None]:
    """Redis unreachable (after the client's retries) → :class:`IndexUnavailableError`."""
    try:
        yield
    except STORE_ERRORS as exc:
        raise IndexUnavailableError(f"redis: {exc}") from exc
    except redis.exceptions.AskError as exc:  # MOVED / ASK reached a standalone client
        raise IndexUnavailableError(f"redis: {CLUSTER_AS_STANDALONE} ({exc})") from exc


def encode_ops(ops: Sequence[Op]) -> bytes:
    """Ops as the fixed 18-byte records ``apply_batch.lua`` reads."""
    return b"".join(starmap(_OP.pack, ops))


@lru_cache(maxsize=4096)
def holder_tiers(value: bytes) -> dict[int, int]:
    """A block's holder records → stream number → best tier (cached, shared: read only)."""
    out: dict[int, int] = {}
    i, size = 0, len(value)
    while i + 2 <= size:  # a torn record at the end (never written) is ignored
        head = value[i] << 8 | value[i + 1]
        form = head & 3
        if form != _LONG_FORM:
            out[head >> 2] = form
            i += 2
            continue
        if i + 8 > size:
            break
        gpu, cpu, _ = _COUNTS.unpack_from(value, i + 2)
        out[head >> 2] = 0 if gpu else 1 if cpu else 2
        i += 8
    return out


@lru_cache(maxsize=4096)
def _prefix(path: tuple[tuple[int, int], ...]) -> PrefixMatch:
    tiers: tuple[Tier, ...] = ()
    for count, tier in path:
        tiers += (_TIERS[tier],) * count
    return PrefixMatch(tiers)


def unpack_runs(packed: bytes) -> Iterator[tuple[int, bytes]]:
    """``longest_prefix.lua``'s runs string → (blocks, holder value) per run."""
    at, size = 0, len(packed)
    while at + _RUN_HEAD.size <= size:
        count, length = _RUN_HEAD.unpack_from(packed, at)
        at += _RUN_HEAD.size
        if at + length > size:
            return
        yield count, packed[at : at + length]
        at += length


def group_matches(packed: bytes) -> dict[int, PrefixMatch]:
    """One group's runs → each holder of the first block → its match up to its first miss."""
    paths: dict[int, list[tuple[int, int]]] = {}
    ended: dict[int, list[tuple[int, int]]] = {}
    for i, (count, value) in enumerate(unpack_runs(packed)):
        tiers = holder_tiers(value)
        if i == 0:
            paths = {number: [(count, tier)] for number, tier in tiers.items()}
            continue
        for number in [n for n in paths if n not in tiers]:
            ended[number] = paths.pop(number)
        for number, path in paths.items():
            path.append((count, tiers[number]))
    ended.update(paths)
    return {number: _prefix(tuple(path)) for number, path in ended.items()}


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a lookup of these streams sends, prepared once for a repeated stream list; a
    group's answer, keyed by (group, #gen, runs), is decoded once."""

    targets: list[StreamId]
    no_match: dict[StreamId, PrefixMatch]  # copied, then the holders' matches set in it
    groups: tuple[int, ...]
    index_of: dict[StreamId, int]
    decoded: dict[tuple[int, bytes, bytes], dict[StreamId, PrefixMatch]] = field(
        default_factory=dict
    )
    held: dict[tuple[int, bytes, bytes], HeldRuns] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Numbering:
    gen: bytes
    names: dict[int, StreamId]


class RedisIndex:
    """Block index in Redis, standalone or Cluster; every method raises
    :class:`IndexUnavailableError` when Redis cannot be reached. ``owner``: this writer's
    lease token; with it a batch or clear of a stream another owner claimed raises
    :class:`FencedError` and changes nothing."""

    def __init__(
        self, client: RedisClient, schema: Schema | None = None, *, owner: str | None = None
    ) -> None:
        self._client = client
        self._schema = (schema or Schema()).for_topology(cluster=isinstance(client, RedisCluster))
        self._owner = owner
        self._apply = client.register_script(
            lua_script(__name__, "apply_batch.lua", after=("holders.lua",))
        )
        self._clear = client.register_script(
            lua_script(__name__, "clear_stream.lua", after=("holders.lua",))
        )
        self._prefix = client.register_script(lua_script(__name__, "longest_prefix.lua"))
        self._registered: set[StreamId] = set()
        self._keys_of: dict[StreamId, tuple[str, ...]] = {}
        self._group_keys = [self._schema.group(g) for g in range(self._schema.index_groups)]
        self._routes: dict[int, dict[str, ClusterNode]] = {}
        self._numbering: dict[int, _Numbering] = {}
        self._plan: _Plan | None = None
        self._identity: bytes | None = None
        self._schema_checked = False

    @property
    def client(self) -> RedisClient:
        return self._client

    @property
    def schema(self) -> Schema:
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
        args += (str(stream), self._schema.index_groups)
        if self._owner is not None:
            args.append(self._owner)
        keys = self._keys(stream)
        with unavailable_on_connection_errors():
            self._register(stream)
            reply = self._apply(keys=keys, args=args)
            if len(reply) == 1:  # the script's fence: another indexer owns the stream
                raise FencedError(f"stream {stream}: owned by another indexer")
            if len(reply) == 2:  # the group was written with another number of groups
                raise self._groups_differ(int(reply[1]))
            if reply[-1]:
                # The stream's state was (re)created by this call: it may have been dropped
                # by another indexer or lost in a Redis restart since this process listed it.
                self._client.sadd(self._schema.streams, str(stream))
        return [
            applied(int(reply[i + 1]), int(reply[i + 2])) if reply[i] else SKIPPED
            for i in range(0, len(reply) - 1, 3)
        ]

    def _groups_differ(self, stored: object) -> SchemaVersionError:
        return SchemaVersionError(
            f"redis prefix {self._schema.prefix!r}: the index was written with {stored} stream"
            f" groups, this process uses {self._schema.index_groups}: every process of a"
            " deployment (indexers, API, proxies) must use the same number (redis_index_groups;"
            f" {TOPOLOGY_INDEX_GROUPS}: {STANDALONE_INDEX_GROUPS} on standalone Redis,"
            f" {CLUSTER_INDEX_GROUPS} on a cluster)"
        )

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
        # One script: the stream out of its group's holders (its own blocks), its own keys
        # deleted; an absent meta reads as watermark -1 and no blocks. Fenced, it first
        # checks the owner and keeps it.
        if not self._forget(stream, drop=False):
            raise FencedError(f"stream {stream}: owned by another indexer")

    def _forget(self, stream: StreamId, *, drop: bool) -> bool:
        """False when fenced (a clear by a writer that lost the stream; a drop never is)."""
        token = "" if drop or self._owner is None else self._owner
        with unavailable_on_connection_errors():
            done = self._clear(keys=self._keys(stream), args=[token, int(drop), str(stream)])
        return bool(done)

    def claim(self, stream: StreamId) -> None:
        """Make this writer the stream's owner; call it before reading the watermark to resume."""
        if self._owner is None:
            return
        with unavailable_on_connection_errors():
            self._client.hset(self._keys(stream)[0], META_OWNER, self._owner)

    def fence_with(self, owner: str) -> None:
        """Fence this writer's later calls with ``owner`` (a sharded indexer's new lease)."""
        self._owner = owner

    def owner(self, stream: StreamId) -> str | None:
        with unavailable_on_connection_errors():
            raw = cast("bytes | None", self._client.hget(self._keys(stream)[0], META_OWNER))
        return None if raw is None else raw.decode()

    def drop(self, stream: StreamId) -> None:
        self._forget(stream, drop=True)
        with unavailable_on_connection_errors():
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
        plan = self._plan_for(list(streams))
        answer = plan.no_match.copy()
        for group, reply in self._group_replies(plan, keys):
            answer.update(self._group_answer(plan, group, reply))
        return answer

    def holders(self, keys: Sequence[int], streams: Sequence[StreamId]) -> HeldRuns:
        """The runs' index lists are shared from call to call: callers only read them."""
        plan = self._plan_for(list(streams))
        runs: HeldRuns = []
        for group, reply in self._group_replies(plan, keys):
            runs += self._group_held(plan, group, reply)
        return runs

    def _group_replies(self, plan: _Plan, keys: Sequence[int]) -> list[tuple[int, list[object]]]:
        if not keys or not plan.groups:
            return []
        if not self._schema_checked:  # once: a mismatched store is an error, not no match
            self.check_schema()
        # Whole keys, big-endian: one C call; the script reads each one's field (low 6 bytes).
        wanted = struct.pack(f">{len(keys)}Q", *keys)
        with unavailable_on_connection_errors():
            try:
                replies = self._prefix_pipeline(plan.groups, wanted)
            except redis.exceptions.NoScriptError:  # Redis restarted or flushed its scripts
                self._client.script_load(self._prefix.script)  # on a cluster: every master
                replies = self._prefix_pipeline(plan.groups, wanted)
        # an empty reply: the group holds nothing of the first block
        return [(g, reply) for g, reply in zip(plan.groups, replies, strict=True) if reply]

    def _group_held(self, plan: _Plan, group: int, reply: list[object]) -> HeldRuns:
        key = (group, cast("bytes", reply[0]), cast("bytes", reply[3]))
        held = plan.held.get(key)
        if held is None:
            index_of = plan.index_of
            by_match: dict[int, tuple[PrefixMatch, list[int]]] = {}
            for stream, match in self._group_answer(plan, group, reply).items():
                by_match.setdefault(id(match), (match, []))[1].append(index_of[stream])
            if len(plan.held) >= _MAX_CACHED:
                plan.held.clear()
            held = plan.held[key] = list(by_match.values())
        return held

    def _group_answer(
        self, plan: _Plan, group: int, reply: list[object]
    ) -> dict[StreamId, PrefixMatch]:
        names = self._names(group, reply)
        gen, runs = cast("bytes", reply[0]), cast("bytes", reply[3])
        key = (group, gen, runs)
        matches = plan.decoded.get(key)
        if matches is None:
            targets = plan.no_match
            named = ((names.get(n), m) for n, m in group_matches(runs).items())
            matches = {s: m for s, m in named if s is not None and s in targets}
            if len(plan.decoded) >= _MAX_CACHED:
                plan.decoded.clear()
            plan.decoded[key] = matches
        return matches

    def _plan_for(self, targets: list[StreamId]) -> _Plan:
        plan = self._plan
        if plan is None or plan.targets != targets:
            groups = tuple(sorted({self._schema.group_of(s) for s in targets}))
            index_of = {s: i for i, s in enumerate(targets)}
            plan = self._plan = _Plan(targets, dict.fromkeys(targets, NO_MATCH), groups, index_of)
        return plan

    def _names(self, group: int, reply: list[object]) -> dict[int, StreamId]:
        gen, groups, roster = cast("tuple[bytes, bytes, list[bytes]]", reply[:3])
        if groups and int(groups) != self._schema.index_groups:
            raise self._groups_differ(int(groups))
        known = self._numbering.get(group)
        if known is not None and known.gen == gen:
            return known.names
        names = {
            int(roster[i + 1]): StreamId.parse(roster[i].decode())
            for i in range(0, len(roster), 2)
            if not roster[i].startswith(b"#")
        }
        self._numbering[group] = _Numbering(gen, names)
        return names

    def _prefix_pipeline(self, groups: tuple[int, ...], wanted: bytes) -> list[list[object]]:
        """Each group's reply in one round trip (one per master on a cluster)."""
        # Raw EVALSHA naming its master: redis-py's Script adds SCRIPT EXISTS in a pipeline,
        # its cluster pipeline refuses evalsha, and unrouted it asks COMMAND GETKEYS per call.
        calls = [groups] if not isinstance(self._client, RedisCluster) else [(g,) for g in groups]
        with self._client.pipeline(transaction=False) as pipe:
            for call in calls:
                names = [name for g in call for name in self._group_keys[g]]
                gens = [self._known_gen(g) for g in call]
                route = self._route(call[0])
                pipe.execute_command(
                    "EVALSHA", self._prefix.sha, len(names), *names, wanted, *gens, **route
                )
            replies = cast("list[list[list[object]]]", pipe.execute())
        return [reply for call_replies in replies for reply in call_replies]

    def _known_gen(self, group: int) -> bytes:
        known = self._numbering.get(group)
        return b"" if known is None else known.gen

    def _route(self, group: int) -> dict[str, ClusterNode]:
        if not isinstance(self._client, RedisCluster):
            return {}
        slot = key_slot(self._group_keys[group][0].encode())
        return {"target_nodes": self._client.nodes_manager.get_node_from_slot(slot)}

    def _keys(self, stream: StreamId) -> tuple[str, ...]:
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

    def check_schema(self) -> None:
        """:class:`SchemaVersionError` when Redis holds an older version or other group count."""
        with unavailable_on_connection_errors():
            found = [name for name in self._schema.old_index_keys() if self._client.exists(name)]
            stored = None if found else self._claim_groups()
        if found:
            raise self._older_schema(found)
        if stored is not None and stored != str(self._schema.index_groups).encode():
            raise self._groups_differ(stored.decode(errors="replace"))
        self._schema_checked = True

    def _claim_groups(self) -> bytes | None:
        key = self._schema.index_groups_key
        self._client.set(key, self._schema.index_groups, nx=True)
        return cast("bytes | None", self._client.get(key))

    def _older_schema(self, found: list[str]) -> SchemaVersionError:
        prefix = self._schema.prefix
        old = [
            glob
            for v in OLD_INDEX_VERSIONS
            if any(name.startswith(f"{prefix}:{v}:") for name in found)
            for glob in self._schema.old_index_globs(v)
        ]
        return SchemaVersionError(
            f"redis holds kvindex index data of an older schema ({', '.join(found)});"
            f" this version uses {INDEX_VERSION} keys and does not read it: stop the older"
            f" processes, delete the old index keys (redis-cli --scan --pattern each of"
            f" {' '.join(repr(g) for g in old)}; no other key), and the indexers refill the"
            " index from the replicas' replay; or keep running the older kvindex"
        )

    def intact(self) -> bool:
        """The marker key still holds the token seen last (a lost one is set anew and adopted)."""
        marker = self._schema.index_marker
        if self._identity is None:
            self.check_schema()
        with unavailable_on_connection_errors():
            token = cast("bytes | None", self._client.get(marker))
            if token is not None and token == self._identity:
                return True
            if token is None:
                self._client.set(marker, secrets.token_hex(8), nx=True)
                token = cast("bytes | None", self._client.get(marker))
                # The data (and so the group count) may be gone: name this process's again.
                self._client.set(self._schema.index_groups_key, self._schema.index_groups, nx=True)
        first = self._identity is None
        self._identity = token
        if not first:
            self._registered.clear()  # the streams SET was lost too: list them again
        return first

    def close(self) -> None:
        self._client.close()


def _watermark(stored: str | None) -> int:
    """The stored watermark as an exact int; -1 when absent or not a decimal integer."""
    if stored is None or not (stored.isascii() and stored.isdigit()) or len(stored) > 20:
        return -1
    return int(stored)
