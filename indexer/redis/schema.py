"""Every Redis key kvindex uses, in one place. Tests import these names too.

Layout (``<p>`` = configurable prefix, ``<v>`` = :data:`SCHEMA_VERSION`, ``<iv>`` =
:data:`INDEX_VERSION` and ``<lv>`` = :data:`LOAD_VERSION`: the block index's keys and the
load's carry a layout version of their own)::

    <p>:<iv>:streams                SET   every stream ("replica/rank") with state
    <p>:<iv>:{ix<g>}:holders         HASH  a group's blocks: block field (low 6 bytes of the
                                          block key) → the group's holders of that block,
                                          packed records (below)
    <p>:<iv>:{ix<g>}:members         HASH  "replica/rank" → its number in group <g>; #gen
                                          (bumped when a number is given or freed), #next,
                                          #free (freed numbers, 2 bytes each), #groups
    <p>:<iv>:{ix<g>}:<replica>/<rank>:hash HASH  engine hash (8 bytes) → block key (8 bytes)
    <p>:<iv>:{ix<g>}:<replica>/<rank>:lost SET  block keys the stream may hold that no engine
                                          hash maps to any more (an engine hash stored again
                                          with another key): what a clear must also visit
    <p>:<iv>:{ix<g>}:<replica>/<rank>:meta HASH  wm (watermark), ts, n0/n1/n2 (blocks per
                                          tier), owner (sharded indexers: the lease token of
                                          the indexer that owns the stream: the batch fence)
    <p>:<iv>:index                  STRING the index's identity: a random token set (if absent)
                                          by the first indexer to open the store; gone
                                          means the data was lost (``RedisIndex.intact``)
    <p>:<iv>:groups                 STRING the number of stream groups the index is kept in:
                                          set (if absent) by the first process to open the
                                          index; one that counts otherwise refuses to start
    <p>:<lv>:{load}:loads           HASH  replica id → its latest load (msgspec JSON, ``Load``);
                                          "<replica id>/answers" → n: /score answers (of every
                                          API process) that chose it since; #epoch (a random
                                          token: the change log's identity), #seq (its last
                                          change), #trimmed (the newest tombstone dropped)
    <p>:<lv>:{load}:changes         ZSET  replica id → #seq of its last put or answer count
    <p>:<lv>:{load}:removed         ZSET  replica id → #seq of its removal (tombstones: the
                                          newest :data:`MAX_LOAD_TOMBSTONES` kept)
    <p>:<v>:scrape:<replica id>     STRING set (NX, expiring within a scrape interval) by the
                                          API process that scrapes the replica this round
    <p>:<v>:{inflight}:totals       HASH  replica id → requests in flight to it (reserved by
                                          proxies, every live lease); "<replica id>/tokens"
                                          → their uncached prompt tokens
    <p>:<v>:{inflight}:leases       ZSET  holder (one proxy process) → when its lease lapses
                                          (ms, Redis server clock), renewed while it lives
    <p>:<v>:{inflight}:lease:<holder> HASH reservation id → "<replica id> <tokens>": what the
                                          holder reserved, taken off the totals when it
                                          releases or its lease lapses
    <p>:<v>:indexers                ZSET  sharded indexers' leases: lease token
                                          ("<indexer id>#<random>") → expiry (unix ms);
                                          ``kvindex.indexer.ingest.membership``
    <p>:<v>:{fleet}:replicas        HASH  replica id → its ReplicaSpec (JSON): the fleet, written
                                          by the indexer (declared, bind-mode) and the API
                                          (POST/DELETE /replicas); ``kvindex.indexer.fleet.sync``;
                                          field ``#fleet`` (never a replica id) marks it
                                          as written by an indexer: absent, Redis lost it
    <p>:<v>:{fleet}:status          HASH  "replica/rank" → the indexer's live state of the stream
                                          (JSON ``StreamRecord``: wall-clock timestamps, counters,
                                          block size) and when it was written; ``#unrouted``
                                          → the bound SUB's frames that reached no stream
    <p>:<v>:{fleet}:health          HASH  replica id → its ReplicaHealth (JSON): active-check
                                          and breaker verdicts, written by API and proxy
                                          processes (``kvindex.indexer.fleet.view``)
    <p>:<v>:health:<replica id>     STRING set (NX, expiring within a check interval) by the
                                          process that health-checks the replica this round

Streams are put in :attr:`Schema.index_groups` groups by a hash of their name
(:meth:`Schema.group_of`): one on standalone Redis, :data:`CLUSTER_INDEX_GROUPS` on a
cluster (the ``redis_index_groups`` setting overrides it); every key of a stream and its
group's two hashes share the hash tag ``{ix<g>}``, so a batch is still one single-slot
script, and a lookup is one script per group on a cluster, one for every group on
standalone Redis (``index/redis.py`` says what it costs). A holder record is 2 bytes,
``number · 4 + form``, when the stream holds the block once on one tier (form 0 GPU, 1 CPU,
2 other), and 8 with form 3: then three u16 counts (gpu, cpu, other) follow. Records are
sorted by number, so two blocks with the same holders and counts have equal values (a
lookup compares them whole). A block held by one stream costs what a v1 per-stream entry
did (a 6-byte field and a 2-byte value: Redis's 8-byte size class); one held by several
costs 2 bytes per holder beyond the first.

Why 6-byte fields: Redis allocates a short string in 8- or 16-byte size classes, and an
8-byte field (with its header) lands in 16 while 6 bytes fit in 8 — 8 bytes saved per block.
A false match then needs two blocks of one group whose keys share their low 48 bits
(probability ~ n / 2⁴⁸ per prompt block, n the group's blocks: 4·10⁻⁹ at a million, the
whole index in the one group of a standalone Redis; 4·10⁻⁷ at a hundred million). The
engine-hash map keeps whole 8-byte keys, because chaining a child block needs its parent's
full key.

Index versions: v3 (one group on standalone Redis) replaced v2 (16 groups wherever), which
replaced v1 (one block hash per stream); the rest of the layout is unchanged (still
:data:`SCHEMA_VERSION` v1). The version is in every index key, so two versions never share
a key: a v2 store's 16 groups are never read as a v3 one's. An index opened on a Redis
that holds v1 or v2 index data raises :class:`SchemaVersionError`
(``RedisIndex.check_schema``) rather than start empty beside it, and so does one whose
group count differs from the ``groups`` key (at open) or a group's ``#groups`` (per call).

Load versions: v2 (a change log beside the load hash, so that an API process reads only
what changed since its last read: ``kvindex.api.load.store``) replaced v1 (the hash alone,
``<p>:v1:load``). A v1 process never bumps the log, so the two never share a key: during a
rolling upgrade each reads the loads written by its own version (every replica's load is
written again within a scrape round).

The load keys share the hash tag ``{load}``: a put, an answer count and a removal change
the hash and the log in one single-slot script.

The in-flight keys share the hash tag ``{inflight}``: a reservation, a release and a lapsed
lease's removal are each one single-slot script.

The fleet hashes share the hash tag ``{fleet}``: removing a replica drops its spec, its
streams' statuses and its health record in one script.

Everything one batch touches shares the stream's group's hash tag ``{ix<g>}``, so the
layout runs unchanged on Redis Cluster: a batch is one single-slot script, and clearing a
stream visits its own blocks (its engine-hash map and ``lost`` set), never a scan. Every
other multi-key call stays on one slot too (the fleet's ``{fleet}`` hashes, the ``{load}``
keys); what touches keys of different slots is separate single-key commands, or a
pipeline of them (scrape claims; the streams SET listing a stream beside its batch), never
one script or transaction. (A lookup on standalone Redis reads every group in one script:
without a cluster, a script's keys need not share a slot.)
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, replace

from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.events import StreamId

SCHEMA_VERSION = "v1"
"""The version of every key but the block index's."""
INDEX_VERSION = "v3"
"""The version of the block index's keys (its streams SET, marker, groups and streams)."""
LOAD_VERSION = "v2"
"""The version of the load's keys (its hash and change log)."""
OLD_INDEX_VERSIONS = ("v1", "v2")
"""Index versions whose data :meth:`RedisIndex.check_schema` refuses to start beside."""
_OLD_INDEX_STREAM_GLOBS = {"v1": "{*/*}:*", "v2": "{ix*}:*"}
"""An old version's per-stream and per-group keys (v1: hash tag "{replica/rank}", v2:
"{ix<g>}"), beside its streams SET and marker: what an operator deletes. Not "<p>:<v>:*":
v1 is also :data:`SCHEMA_VERSION` and v2 :data:`LOAD_VERSION`, whose keys are kept."""
TOPOLOGY_INDEX_GROUPS = 0
"""``Schema.index_groups`` (and the ``redis_index_groups`` setting) meaning "by topology":
:data:`STANDALONE_INDEX_GROUPS` on standalone Redis, :data:`CLUSTER_INDEX_GROUPS` on a
cluster (:meth:`Schema.for_topology`, which ``RedisIndex`` calls)."""
STANDALONE_INDEX_GROUPS = 1
"""Stream groups on standalone Redis. A lookup walks the prompt once per group holding
it, so one group walks a prefix the whole fleet shares once (with 16 its 64 blocks were
walked in each of the 16 groups at 1,024 replicas); on one server the groups spread
nothing."""
CLUSTER_INDEX_GROUPS = 16
"""Stream groups on Redis Cluster: what spreads the index over the masters (16 slots over
3 masters: 4-7 each); a lookup sends one script per group holding a requested stream. A
group holds at most :data:`MAX_GROUP_STREAMS` streams."""
MAX_INDEX_GROUPS = 1024
MAX_GROUP_STREAMS = 16384
"""A holder record's number has 14 bits (``apply_batch.lua`` refuses a stream beyond)."""
DEFAULT_PREFIX = "kvindex"

_SAFE = re.compile(r"[A-Za-z0-9._:\-]+")


class SchemaError(KvIndexError):
    """A prefix or replica id that cannot be used in a Redis key."""


class SchemaVersionError(SchemaError):
    """The Redis holds index data of another layout (an older schema version, or another
    number of stream groups) that this process would not read: it refuses rather than mix."""


def check_name(kind: str, value: str) -> str:
    """Reject names that would break key parsing or Cluster hash tags (``{``, ``}``, ``/``)."""
    # fullmatch, not match with "$": "$" also matches before a trailing newline.
    if not _SAFE.fullmatch(value):
        raise SchemaError(f"{kind} {value!r} must match {_SAFE.pattern}")
    return value


@dataclass(frozen=True, slots=True)
class StreamKeys:
    """A stream's own keys and its group's (one hash tag: one slot)."""

    meta: str
    hashes: str
    lost: str
    holders: str
    members: str

    def all(self) -> tuple[str, str, str, str, str]:
        """In the order ``apply_batch.lua`` and ``clear_stream.lua`` read them."""
        return (self.meta, self.hashes, self.lost, self.holders, self.members)

    def own(self) -> tuple[str, str, str]:
        """The stream's own keys (not its group's)."""
        return (self.meta, self.hashes, self.lost)


@dataclass(frozen=True, slots=True)
class Schema:
    """Key names under one prefix."""

    prefix: str = DEFAULT_PREFIX
    index_groups: int = TOPOLOGY_INDEX_GROUPS
    """Stream groups of the block index, 1 to :data:`MAX_INDEX_GROUPS`, or
    :data:`TOPOLOGY_INDEX_GROUPS` (0): chosen by the Redis (:meth:`for_topology`). Every
    process of a deployment must agree: the ``groups`` key and each group's ``#groups``
    field say which count wrote it."""

    def __post_init__(self) -> None:
        check_name("key prefix", self.prefix)
        if not 0 <= self.index_groups <= MAX_INDEX_GROUPS:
            raise SchemaError(
                f"index groups {self.index_groups!r}: 1 to {MAX_INDEX_GROUPS}"
                f" ({TOPOLOGY_INDEX_GROUPS}: by topology)"
            )

    def for_topology(self, *, cluster: bool) -> Schema:
        """This schema with its group count chosen for the Redis, when it is
        :data:`TOPOLOGY_INDEX_GROUPS`: :data:`CLUSTER_INDEX_GROUPS` on a cluster,
        :data:`STANDALONE_INDEX_GROUPS` on standalone Redis; a count given is kept."""
        if self.index_groups != TOPOLOGY_INDEX_GROUPS:
            return self
        groups = CLUSTER_INDEX_GROUPS if cluster else STANDALONE_INDEX_GROUPS
        return replace(self, index_groups=groups)

    @property
    def num_groups(self) -> int:
        """The group count, once chosen (:meth:`for_topology`); the block index's key
        names need it, so asking an unchosen schema for them is a :class:`SchemaError`."""
        if self.index_groups == TOPOLOGY_INDEX_GROUPS:
            raise SchemaError("index groups not chosen yet: Schema.for_topology chooses them")
        return self.index_groups

    @property
    def root(self) -> str:
        return f"{self.prefix}:{SCHEMA_VERSION}"

    @property
    def index_root(self) -> str:
        """The block index's keys' root (its own version, :data:`INDEX_VERSION`)."""
        return f"{self.prefix}:{INDEX_VERSION}"

    @property
    def streams(self) -> str:
        return f"{self.index_root}:streams"

    @property
    def index_marker(self) -> str:
        """The STRING whose token identifies the index's data; absent or changed: lost."""
        return f"{self.index_root}:index"

    @property
    def index_groups_key(self) -> str:
        """The STRING holding the group count the index is kept in (set by its first
        opener; ``RedisIndex.check_schema`` compares it)."""
        return f"{self.index_root}:groups"

    @property
    def load(self) -> str:
        """The HASH replica id → latest ``api.load.model.Load``, its answer counts and the
        change log's fields (:data:`LOAD_EPOCH`, :data:`LOAD_SEQ`, :data:`LOAD_TRIMMED`)."""
        return f"{self.prefix}:{LOAD_VERSION}:{{load}}:loads"

    @property
    def load_changes(self) -> str:
        """The ZSET replica id → the change seq of its last put or answer count."""
        return f"{self.prefix}:{LOAD_VERSION}:{{load}}:changes"

    @property
    def load_removed(self) -> str:
        """The ZSET replica id → the change seq of its removal (tombstones)."""
        return f"{self.prefix}:{LOAD_VERSION}:{{load}}:removed"

    @property
    def indexers(self) -> str:
        """The ZSET of sharded indexers' leases: lease token → expiry (unix milliseconds)."""
        return f"{self.root}:indexers"

    def scrape_claim(self, replica: str) -> str:
        """A short-lived key: the API process that set it scrapes ``replica`` this round."""
        return f"{self.root}:scrape:{replica}"

    @property
    def in_flight(self) -> str:
        """The HASH replica id → requests in flight (and ``tokens_field`` → their tokens)."""
        return f"{self.root}:{{inflight}}:totals"

    @property
    def leases(self) -> str:
        """The ZSET holder → when its lease lapses (ms since the epoch, Redis' clock)."""
        return f"{self.root}:{{inflight}}:leases"

    def lease(self, holder: str) -> str:
        """The HASH reservation id → "<replica> <tokens>" of one holder's lease."""
        check_name("lease holder", holder)
        return f"{self.root}:{{inflight}}:lease:{holder}"

    @property
    def replicas(self) -> str:
        """The HASH replica id → :class:`~kvindex.indexer.fleet.replica.ReplicaSpec` as JSON."""
        return f"{self.root}:{{fleet}}:replicas"

    @property
    def stream_status(self) -> str:
        """The HASH "replica/rank" → ``kvindex.indexer.fleet.sync.StreamRecord`` as JSON."""
        return f"{self.root}:{{fleet}}:status"

    @property
    def replica_health(self) -> str:
        """The HASH replica id → ``kvindex.indexer.fleet.replica_health.ReplicaHealth``."""
        return f"{self.root}:{{fleet}}:health"

    def health_claim(self, replica: str) -> str:
        """A short-lived key: the process that set it health-checks ``replica`` this round."""
        return f"{self.root}:health:{replica}"

    def old_index_keys(self) -> list[str]:
        """Keys an index of an older schema version leaves (its streams SET and marker)."""
        old = [f"{self.prefix}:{v}" for v in OLD_INDEX_VERSIONS]
        return [name for root in old for name in (f"{root}:streams", f"{root}:index")]

    def old_index_globs(self, version: str) -> list[str]:
        """Every key of an older index version, as ``SCAN MATCH`` patterns (its streams SET,
        its marker, its streams' and groups' keys), and only those."""
        root = f"{self.prefix}:{version}"
        return [f"{root}:streams", f"{root}:index", f"{root}:{_OLD_INDEX_STREAM_GLOBS[version]}"]

    def group_of(self, stream: StreamId) -> int:
        """The stream's group: CRC-32 of its name, so every process agrees with no lookup."""
        return zlib.crc32(str(stream).encode()) % self.num_groups

    def group(self, group: int) -> tuple[str, str]:
        """(holders, members) of one group."""
        tag = f"{self.index_root}:{{ix{group}}}"
        return f"{tag}:holders", f"{tag}:members"

    def stream(self, stream: StreamId) -> StreamKeys:
        holders, members = self.group(self.group_of(stream))
        own = f"{self.index_root}:{{ix{self.group_of(stream)}}}:{stream}"
        return StreamKeys(f"{own}:meta", f"{own}:hash", f"{own}:lost", holders, members)


ANSWERS_SUFFIX = "/answers"


def answers_field(replica: str) -> str:
    """The field of the load HASH counting answers that chose ``replica`` (``/`` is never in
    a replica id, so it cannot clash with a replica's own field)."""
    return f"{replica}{ANSWERS_SUFFIX}"


LOAD_EPOCH = "#epoch"
"""Field of the load HASH: the change log's identity, a random token set by the first write
to a hash without one (``#`` is never in a replica id). Gone or changed: the hash was lost
(FLUSHALL, a Redis restarted empty) and a reader's snapshot is void."""
LOAD_SEQ = "#seq"
"""Field of the load HASH: the number of the last change (HINCRBY per change)."""
LOAD_TRIMMED = "#trimmed"
"""Field of the load HASH: the seq of the newest tombstone dropped from the removed ZSET; a
reader whose last seq is below it may have missed a removal, so it reads everything."""
MAX_LOAD_TOMBSTONES = 1024
"""Removals remembered in the removed ZSET (replica ids come and go: pod names)."""


TOKENS_SUFFIX = "/tokens"


def tokens_field(replica: str) -> str:
    """The field of the in-flight HASH holding the tokens of the requests in flight to
    ``replica`` (beside its own field, their number)."""
    return f"{replica}{TOKENS_SUFFIX}"


FLEET_MARKER = "#fleet"
"""Field of the replicas hash an indexer sets; without it the hash was lost (not emptied)."""

UNROUTED_FIELD = "#unrouted"
"""Field of the stream-status hash holding the indexer's counters of bound-SUB frames that
reached no stream (JSON ``UnroutedCounters``; ``#`` is never in a stream key)."""

META_WATERMARK = "wm"
META_TS = "ts"
META_OWNER = "owner"
"""Meta field holding the lease token of the stream's owner (``apply_batch.lua`` and
``clear_stream.lua`` read it by this name: the fence)."""
META_TIER_PREFIX = "n"
"""Meta fields ``n0``, ``n1``, ``n2``: distinct blocks held per tier (by Tier value)."""
