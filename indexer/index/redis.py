"""The Redis :class:`~kvindex.indexer.index.protocol.BlockIndex`: the shared, production store.

Layout (index version v3, ``redis_schema``): streams are put in a fixed number of groups by a
hash of their name (by topology: one on standalone Redis, 16 on a cluster; the
``redis_index_groups`` setting overrides it); each group keeps one hash, block → the packed
records of its holders in the group (a stream's number there and its counts per tier, 2
bytes in the common case), and each stream keeps its engine-hash map and meta. Every key
of a stream and its group's share one hash tag, so a batch is one single-slot script on
Redis Cluster too.

One Lua script per call of :meth:`RedisIndex.apply_many` (``apply_batch.lua``) applies
every op and moves the watermark atomically; a retry after a dropped connection finds the
watermark already moved and is a no-op. Sharded indexers (``owner``): the batch script and
``clear_stream.lua`` first compare the writer's lease token with the stream's ``owner``
meta field (same slot), so a writer another indexer has claimed the stream from changes
nothing (:class:`FencedError`).

What a lookup costs: one round trip of one ``longest_prefix.lua`` call (on a cluster, one
call per group holding a requested stream, sent to every master before any reply is read).
Per group, the script walks the prompt's blocks once, keeping the set of the group's
streams that hold every block so far, and stops at the first block none of them holds: it
reads the group's longest match plus one block, and a group holding nothing of the first
block costs one HGET (its numbering is not read then). The walk reads a chunk of blocks per
HMGET (32, or a quarter of what it read so far, up to 256): a command called from Lua has
a fixed cost of about four field reads, so one HGET per block (as until now) spent most of
the script in calls; what a chunk reads beyond the walk's end costs less. The set is only
recomputed where a block's holder value differs from the one before (equal holders and
counts give equal values), so a system prompt shared by many streams costs one pass over
its holders, not one per block. The answer is one string of runs (blocks, holder value)
per group; this process decodes a group's string once per numbering (``#gen``) and keeps
the requested streams' matches by it, so a repeated answer (the caches did not change)
costs a dict lookup and an update per group, whatever the number of holders, and the
requested streams that hold nothing share one prepared answer. So the cost follows the
groups (a constant), the longest match in each, not the number of streams: 1,024 replicas
of which 256 share a 64-block system prompt cost 16 walks of at most their group's longest
match each (about 1,700 fields), not one walk per stream (v1: one HGET per stream that
holds nothing, n + 1 per stream matching n blocks: about 18,000 HGETs). Redis instructions
per lookup of ``bench/score.py``'s prompt (callgrind, 1,024 blocks a replica): 3.3 M at 32
replicas, 5.9 M at 1,024 (one HGET a block: 5.4 M, 9.4 M). What is left growing with the
fleet is the shared prefix read once per group holding it (16 groups hold the system
prompt at 1,024 replicas, 7 at 32), and a field read from Lua costs one to two thousand
instructions whatever the script does with it.

What the groups cost: a prefix held in every group (the shared system prompt) is walked
once per group, and on standalone Redis one call carries every group (a call per group
copied the 4 KB prompt into Lua 16 times: 17 EVALSHAs at 32 replicas). Fewer groups walk a
shared prefix fewer times (1,024 replicas: 676 HGETs with 4 groups, 1,128 with 8, 1,680
with 16). On a cluster the groups are what spreads the index over the masters, so 16
(``redis_schema.CLUSTER_INDEX_GROUPS``); on standalone Redis they spread nothing, so one
(``STANDALONE_INDEX_GROUPS``): the shared prefix is walked once, and Redis instructions
per lookup of ``bench/score.py``'s prompt fell from 3.2 M to 1.7 M at 32 replicas and
from 5.9 M to 2.7 M at 1,024 (callgrind; 1.6 times from 32 to 1,024, was 1.9).

Opening: :meth:`RedisIndex.check_schema` (the indexer's first :meth:`RedisIndex.intact`,
the API's start, else the first lookup) refuses a Redis holding an older index version or
one kept in another group count (the ``groups`` key the first opener set): a few
single-key calls, once per process.

A holder's number is only meaningful with the group's numbering: the script returns the
group's ``#gen`` (bumped whenever a number is given or freed) and the whole numbering when
it differs from the one this process holds, read in the same script as the holders, so a
number reused after a drop is never read with the stream that had it before.

What a write costs: per store or removal, one HGET of the block's holder value the first
time the call meets the block, Lua work on its records (a few bytes per holder of the
group), and the values and engine-hash mappings written once at the end in bulk HSETs;
per call, one HMGET of the stored engine hashes' old mappings (an engine hash stored again
with another key leaves that key in the stream's ``lost`` set, so a clear still finds it).
Clearing or dropping a stream visits its own blocks (its engine-hash map and lost set),
never the group's others.

Memory: a block held by one stream is one field of its group's hash (6 bytes) with a 2-byte
value, what a v1 per-stream block field cost; each further holder adds 2 bytes to the value
instead of an entry. The engine-hash map is as in v1.
"""

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
_MAX_CACHED = 1024
"""Group answers a lookup plan keeps decoded (a prompt's answers repeat while the caches
do not change); beyond, the plan's cache starts afresh."""
_TIERS = tuple(Tier)
_LONG_FORM = 3
"""A holder record's form carrying its counts (``redis_schema``); forms 0-2 are one block
on that tier."""


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


def encode_ops(ops: Sequence[Op]) -> bytes:
    """Ops as the fixed 18-byte records ``apply_batch.lua`` reads."""
    return b"".join(starmap(_OP.pack, ops))


@lru_cache(maxsize=4096)
def holder_tiers(value: bytes) -> dict[int, int]:
    """A block's holder records (``redis_schema``) → stream number → its best tier (0 GPU,
    1 CPU, 2 other). Cached: a prompt's values repeat from lookup to lookup. The dict is
    shared: callers only read it."""
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
    """(blocks, tier) runs → their match (cached: many holders share a path)."""
    tiers: tuple[Tier, ...] = ()
    for count, tier in path:
        tiers += (_TIERS[tier],) * count
    return PrefixMatch(tiers)


def unpack_runs(packed: bytes) -> Iterator[tuple[int, bytes]]:
    """``longest_prefix.lua``'s runs string → (blocks, holder value) per run. A torn run at
    the end (never written) is ignored."""
    at, size = 0, len(packed)
    while at + _RUN_HEAD.size <= size:
        count, length = _RUN_HEAD.unpack_from(packed, at)
        at += _RUN_HEAD.size
        if at + length > size:
            return
        yield count, packed[at : at + length]
        at += length


def group_matches(packed: bytes) -> dict[int, PrefixMatch]:
    """``longest_prefix.lua``'s runs of one group → each holder of the first block → its
    match: the blocks up to its first miss, with their best tiers."""
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
    """What a lookup of these streams sends, prepared once for a repeated stream list."""

    targets: list[StreamId]
    no_match: dict[StreamId, PrefixMatch]
    """Every target → :data:`NO_MATCH`: copied, then the holders' matches set in it."""
    groups: tuple[int, ...]
    """The groups holding a target."""
    index_of: dict[StreamId, int]
    """Every target → its index in ``targets`` (:meth:`RedisIndex.holders`' answer)."""
    decoded: dict[tuple[int, bytes, bytes], dict[StreamId, PrefixMatch]] = field(
        default_factory=dict
    )
    """(group, #gen, runs) → the targets' matches in it: a group's answer decoded once."""
    held: dict[tuple[int, bytes, bytes], HeldRuns] = field(default_factory=dict)
    """(group, #gen, runs) → the same matches as runs of target indices (one per match)."""


@dataclass(frozen=True, slots=True)
class _Numbering:
    """One group's numbering as of its ``#gen``."""

    gen: bytes
    names: dict[int, StreamId]


class RedisIndex:
    """Block index in Redis, standalone or Cluster (``redis_connection`` builds either).

    Every method raises :class:`IndexUnavailableError` when Redis cannot be reached.

    ``owner``: this writer's lease token (sharded indexers, ``kvindex.indexer.ingest.membership``).
    With it every batch and clear is fenced inside its script: a stream whose meta names
    another owner is left as it is and :class:`FencedError` raised; :meth:`claim` makes the
    token the stream's owner. Without it (one indexer per store) nothing is fenced.
    """

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
        """The marker token this index last saw (None: not looked at yet)."""
        self._schema_checked = False
        """Whether :meth:`check_schema` passed (a lookup runs it if not)."""

    @property
    def client(self) -> RedisClient:
        """The connection (other stores of the same deployment share it, e.g. load)."""
        return self._client

    @property
    def schema(self) -> Schema:
        """Its key names, its group count chosen for this Redis (other shared state of the
        deployment uses the same prefix)."""
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
        """``clear_stream.lua``: False when fenced (a clear by a writer that lost the
        stream; a drop is never fenced)."""
        token = "" if drop or self._owner is None else self._owner
        with unavailable_on_connection_errors():
            done = self._clear(keys=self._keys(stream), args=[token, int(drop), str(stream)])
        return bool(done)

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
        """:meth:`longest_prefix`'s holders by index in ``streams`` (distinct;
        :class:`~kvindex.indexer.index.protocol.HolderLookup`): the same calls to Redis,
        but nothing made per stream asked, so the Python side follows the holders (a
        group's runs are made once per answer of the group). The runs' index lists are
        shared from call to call: callers only read them."""
        plan = self._plan_for(list(streams))
        runs: HeldRuns = []
        for group, reply in self._group_replies(plan, keys):
            runs += self._group_held(plan, group, reply)
        return runs

    def _group_replies(self, plan: _Plan, keys: Sequence[int]) -> list[tuple[int, list[object]]]:
        """(group, reply) of each of the plan's groups holding ``keys[0]``: one pipeline."""
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
        """One group's reply → its holders among the targets, in runs of one match object
        (``_prefix`` shares one per path), made once per answer as :meth:`_group_answer`."""
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
        """One group's reply → the plan's targets it holds → their matches (decoded once
        per group, #gen and runs: the key names the numbering the numbers are from)."""
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
        """The prepared answer and groups of ``targets`` (kept while the list repeats, as
        the API's does: the list compared, no stream hashed)."""
        plan = self._plan
        if plan is None or plan.targets != targets:
            groups = tuple(sorted({self._schema.group_of(s) for s in targets}))
            index_of = {s: i for i, s in enumerate(targets)}
            plan = self._plan = _Plan(targets, dict.fromkeys(targets, NO_MATCH), groups, index_of)
        return plan

    def _names(self, group: int, reply: list[object]) -> dict[int, StreamId]:
        """The group's numbering as of this reply (its #gen; the roster when it changed)."""
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
        """One round trip (on a cluster, one per master, all sent before any is read), each
        group's reply in order: one EVALSHA for every group on standalone Redis, one per
        group on a cluster (a script's keys share a slot). Sent as a raw command: redis-py's
        Script would add SCRIPT EXISTS in a pipeline, and its cluster pipeline refuses
        ``evalsha``; on a cluster each names its master, else redis-py would ask a node for
        the command's keys (COMMAND GETKEYS) one round trip at a time."""
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
        """The #gen of the group's numbering this process holds (b"": none yet)."""
        known = self._numbering.get(group)
        return b"" if known is None else known.gen

    def _route(self, group: int) -> dict[str, ClusterNode]:
        """On a cluster, the pipeline option naming the master of the group's slot."""
        if not isinstance(self._client, RedisCluster):
            return {}
        slot = key_slot(self._group_keys[group][0].encode())
        return {"target_nodes": self._client.nodes_manager.get_node_from_slot(slot)}

    def _keys(self, stream: StreamId) -> tuple[str, ...]:
        """(meta, hash, lost, holders, members) names of a stream, computed once."""
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
        """Raise :class:`SchemaVersionError` when the Redis holds this prefix's index data
        in an older schema version (its streams SET or marker: this version would start
        empty beside it and never read it), or in another number of stream groups (the
        ``groups`` key, set here when absent: the first process to open the index names the
        count). One EXISTS per old key and a SET NX and GET (each its own slot). Every
        process opening the index runs it: the indexer at its first :meth:`intact`, the API
        at start, and a lookup if it has not passed yet (a batch is refused by its group's
        ``#groups``)."""
        with unavailable_on_connection_errors():
            found = [name for name in self._schema.old_index_keys() if self._client.exists(name)]
            stored = None if found else self._claim_groups()
        if found:
            raise self._older_schema(found)
        if stored is not None and stored != str(self._schema.index_groups).encode():
            raise self._groups_differ(stored.decode(errors="replace"))
        self._schema_checked = True

    def _claim_groups(self) -> bytes | None:
        """The ``groups`` key's count, this process's set first if it had none."""
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
        """The marker key holds the token seen last time: one GET. Absent (the data was
        lost), a new token is set unless another process set one first, and adopted; a
        token that changed means another process saw the loss first. The first call also
        runs :meth:`check_schema` (the indexer's start: a clear error, not a mixed store)."""
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
    """The stored watermark as an exact int; -1 when absent or not a decimal integer (a
    float such as ``3e+18`` written before seqs were compared as strings: the script treats
    it the same way and overwrites it with the next batch)."""
    if stored is None or not (stored.isascii() and stored.isdigit()) or len(stored) > 20:
        return -1
    return int(stored)
