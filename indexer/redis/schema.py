"""Every Redis key kvindex uses, in one place, with its layout version; tests import these too.

Keys are ``<prefix>:<version>:…`` (:data:`INDEX_VERSION` for the block index, :data:`LOAD_VERSION`
for the load, :data:`SCHEMA_VERSION` else), so two layouts never share a key. Keys changed together
share a hash tag (``{ix<g>}``, ``{load}``, ``{inflight}``, ``{fleet}``): one slot, one script."""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, replace

from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.events import StreamId

SCHEMA_VERSION = "v1"
INDEX_VERSION = "v3"
LOAD_VERSION = "v2"
OLD_INDEX_VERSIONS = ("v1", "v2")
_OLD_INDEX_STREAM_GLOBS = {"v1": "{*/*}:*", "v2": "{ix*}:*"}
TOPOLOGY_INDEX_GROUPS = 0  # index groups chosen by Schema.for_topology
STANDALONE_INDEX_GROUPS = 1  # a lookup walks the prompt once per group
CLUSTER_INDEX_GROUPS = 16  # what spreads the index over the masters
MAX_INDEX_GROUPS = 1024
MAX_GROUP_STREAMS = 16384  # a holder record's number has 14 bits
DEFAULT_PREFIX = "kvindex"

_SAFE = re.compile(r"[A-Za-z0-9._:\-]+")


class SchemaError(KvIndexError):
    """A prefix or replica id that cannot be used in a Redis key."""


class SchemaVersionError(SchemaError):
    """Redis holds index data of another layout or group count: refused rather than mixed."""


def check_name(kind: str, value: str) -> str:
    # fullmatch, not match with "$": "$" also matches before a trailing newline.
    if not _SAFE.fullmatch(value):
        raise SchemaError(f"{kind} {value!r} must match {_SAFE.pattern}")
    return value


@dataclass(frozen=True, slots=True)
class StreamKeys:
    """A stream's own keys and its group's, under one hash tag."""

    meta: str
    hashes: str
    lost: str
    holders: str
    members: str

    def all(self) -> tuple[str, str, str, str, str]:
        return (self.meta, self.hashes, self.lost, self.holders, self.members)

    def own(self) -> tuple[str, str, str]:
        return (self.meta, self.hashes, self.lost)


@dataclass(frozen=True, slots=True)
class Schema:
    prefix: str = DEFAULT_PREFIX
    index_groups: int = TOPOLOGY_INDEX_GROUPS

    def __post_init__(self) -> None:
        check_name("key prefix", self.prefix)
        if not 0 <= self.index_groups <= MAX_INDEX_GROUPS:
            raise SchemaError(
                f"index groups {self.index_groups!r}: 1 to {MAX_INDEX_GROUPS}"
                f" ({TOPOLOGY_INDEX_GROUPS}: by topology)"
            )

    def for_topology(self, *, cluster: bool) -> Schema:
        if self.index_groups != TOPOLOGY_INDEX_GROUPS:
            return self
        groups = CLUSTER_INDEX_GROUPS if cluster else STANDALONE_INDEX_GROUPS
        return replace(self, index_groups=groups)

    @property
    def num_groups(self) -> int:
        if self.index_groups == TOPOLOGY_INDEX_GROUPS:
            raise SchemaError("index groups not chosen yet: Schema.for_topology chooses them")
        return self.index_groups

    @property
    def root(self) -> str:
        return f"{self.prefix}:{SCHEMA_VERSION}"

    @property
    def index_root(self) -> str:
        return f"{self.prefix}:{INDEX_VERSION}"

    @property
    def streams(self) -> str:
        return f"{self.index_root}:streams"

    @property
    def index_marker(self) -> str:
        return f"{self.index_root}:index"

    @property
    def index_groups_key(self) -> str:
        return f"{self.index_root}:groups"

    @property
    def load(self) -> str:
        return f"{self.prefix}:{LOAD_VERSION}:{{load}}:loads"

    @property
    def load_changes(self) -> str:
        return f"{self.prefix}:{LOAD_VERSION}:{{load}}:changes"

    @property
    def load_removed(self) -> str:
        return f"{self.prefix}:{LOAD_VERSION}:{{load}}:removed"

    @property
    def indexers(self) -> str:
        """Sharded indexers' leases: in the fleet's slot, so a status write checks its lease."""
        return f"{self.root}:{{fleet}}:indexers"

    @property
    def stream_owners(self) -> str:
        """Stream → the lease token that claimed it (what a status write is checked against)."""
        return f"{self.root}:{{fleet}}:owners"

    def scrape_claim(self, replica: str) -> str:
        return f"{self.root}:scrape:{replica}"

    @property
    def in_flight(self) -> str:
        return f"{self.root}:{{inflight}}:totals"

    @property
    def leases(self) -> str:
        return f"{self.root}:{{inflight}}:leases"

    def lease(self, holder: str) -> str:
        check_name("lease holder", holder)
        return f"{self.root}:{{inflight}}:lease:{holder}"

    @property
    def replicas(self) -> str:
        return f"{self.root}:{{fleet}}:replicas"

    @property
    def stream_status(self) -> str:
        return f"{self.root}:{{fleet}}:status"

    @property
    def replica_health(self) -> str:
        return f"{self.root}:{{fleet}}:health"

    @property
    def discovered(self) -> str:
        """Replica id → the discovery that registered it (namespace, then pool or selector)."""
        return f"{self.root}:{{fleet}}:discovered"

    @property
    def clear_asks(self) -> str:
        """Replica id → when a proxy last asked its streams' blocks dropped (wall clock)."""
        return f"{self.root}:{{fleet}}:clear_asks"

    def health_claim(self, replica: str) -> str:
        return f"{self.root}:health:{replica}"

    @property
    def receipts(self) -> str:
        """The proxies' route journal: a Stream trimmed to ``proxy.journal_stream_maxlen``."""
        return f"{self.root}:{{receipts}}:journal"

    def old_index_keys(self) -> list[str]:
        old = [f"{self.prefix}:{v}" for v in OLD_INDEX_VERSIONS]
        return [name for root in old for name in (f"{root}:streams", f"{root}:index")]

    def old_index_globs(self, version: str) -> list[str]:
        root = f"{self.prefix}:{version}"
        return [f"{root}:streams", f"{root}:index", f"{root}:{_OLD_INDEX_STREAM_GLOBS[version]}"]

    def group_of(self, stream: StreamId) -> int:
        # CRC-32 of the name: every process agrees with no lookup.
        return zlib.crc32(str(stream).encode()) % self.num_groups

    def group(self, group: int) -> tuple[str, str]:
        tag = f"{self.index_root}:{{ix{group}}}"
        return f"{tag}:holders", f"{tag}:members"

    def stream(self, stream: StreamId) -> StreamKeys:
        holders, members = self.group(self.group_of(stream))
        own = f"{self.index_root}:{{ix{self.group_of(stream)}}}:{stream}"
        return StreamKeys(f"{own}:meta", f"{own}:hash", f"{own}:lost", holders, members)


ANSWERS_SUFFIX = "/answers"


def answers_field(replica: str) -> str:
    return f"{replica}{ANSWERS_SUFFIX}"


LOAD_EPOCH = "#epoch"  # the change log's identity; gone or changed: lost
LOAD_SEQ = "#seq"
LOAD_TRIMMED = "#trimmed"  # the seq of the newest tombstone dropped
MAX_LOAD_TOMBSTONES = 1024


TOKENS_SUFFIX = "/tokens"


def tokens_field(replica: str) -> str:
    return f"{replica}{TOKENS_SUFFIX}"


FLEET_MARKER = "#fleet"  # set by an indexer; without it the hash was lost, not emptied
UNROUTED_FIELD = "#unrouted"  # the bound SUB's unrouted counters (JSON)

META_WATERMARK = "wm"
META_TS = "ts"
META_OWNER = "owner"  # the lease token of the stream's owner: the fence the scripts read
META_TIER_PREFIX = "n"
