"""The block index: one Protocol, two backends (``memory_store``, ``redis_store``).

The index holds, per stream (replica, data-parallel rank):

* block key → how many times the block is cached on each tier (GPU / CPU / other);
* engine hash → block key, so that ``BlockRemoved`` (which names engine hashes) and
  tokenless CPU-offload stores can be applied;
* the stream's watermark (last applied seq, an exact ``int``: seqs are
  ``0 <= seq < MAX_SEQ``, vLLM's unsigned 64-bit counter) and the time of its last batch.

Guarantees every backend gives (the contract suite in ``tests/contract`` checks them):

* :meth:`BlockIndex.apply` applies one batch of :data:`Op` atomically together with the
  watermark; a batch at or below the watermark is a no-op (replay overlap and two
  indexers on one stream are safe, and a retry after a dropped connection is idempotent).
* Counts are per (stream, block, tier): a block stored twice needs two removals, and a
  block removed from CPU is still matched while GPU holds it.
* :meth:`BlockIndex.longest_prefix` stops at the first missing key per stream;
  :func:`prefix_holders` is the same answer without the streams that match nothing.
* Clearing or dropping a stream costs that stream's own blocks, never a keyspace scan.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias, runtime_checkable

from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.events import StreamId, Tier

MAX_SEQ = 2**64
"""Seqs are below this (the wire's 8-byte unsigned counter); backends store them exactly."""


class IndexUnavailableError(KvIndexError):
    """The index store cannot be reached (e.g. Redis is down); retry later."""


class OpKind(enum.IntEnum):
    """Index operations. Values are stable: the Redis script reads them."""

    STORE = 0
    """Count ``key`` once more on ``tier``; map ``engine_hash`` → ``key``."""
    STORE_BY_HASH = 1
    """Like STORE, with the key found through the engine-hash map (tokenless stores)."""
    REMOVE = 2
    """Count the block of ``engine_hash`` once less on ``tier``."""
    CLEAR = 3
    """Forget every block of the stream (``AllBlocksCleared``); the watermark moves on."""


Op: TypeAlias = tuple[OpKind, Tier, int, int]
"""``(kind, tier, engine_hash, key)``; fields an op does not use are 0."""

BatchOps: TypeAlias = tuple[int, float, Sequence[Op]]
"""One batch ready for the index: ``(seq, engine ts, ops)``."""


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """What applying one batch did."""

    applied: bool
    """False when the batch was at or below the watermark (nothing changed)."""
    num_unknown_removals: int = 0
    """REMOVE ops whose engine hash (or tier) was not held: no-ops, counted."""
    num_unresolved_stores: int = 0
    """STORE_BY_HASH ops whose engine hash was unknown: skipped, counted."""


SKIPPED = ApplyResult(applied=False)
APPLIED = ApplyResult(applied=True)
"""A batch applied with nothing to count (the common case: shared, not allocated)."""


def applied(num_unknown_removals: int, num_unresolved_stores: int) -> ApplyResult:
    """The result of a batch applied above the watermark."""
    if num_unknown_removals or num_unresolved_stores:
        return ApplyResult(True, num_unknown_removals, num_unresolved_stores)
    return APPLIED


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest run of leading keys one stream holds, with the best tier of each."""

    tiers: tuple[Tier, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.tiers)


NO_MATCH = PrefixMatch()


@dataclass(frozen=True, slots=True)
class StreamStats:
    stream: StreamId
    watermark: int
    """Last applied seq; -1 before the first batch (or after a restart cleared it)."""
    last_event_ts: float | None
    """The ``ts`` of the last applied batch (engine wall clock, seconds since the epoch)."""
    blocks_by_tier: dict[Tier, int] = field(default_factory=dict)
    """Distinct blocks held on each tier."""

    @property
    def num_blocks(self) -> int:
        return sum(self.blocks_by_tier.values())


class BlockIndex(Protocol):
    """Where every cached block lives. Implementations are safe to call from any thread."""

    def apply(self, stream: StreamId, seq: int, ts: float, ops: Sequence[Op]) -> ApplyResult:
        """Apply one batch atomically with the watermark; ``seq`` ≤ watermark is a no-op."""
        ...

    def apply_many(self, stream: StreamId, batches: Sequence[BatchOps]) -> list[ApplyResult]:
        """Apply consecutive batches of one stream in order, each as :meth:`apply` would
        (one round trip on Redis: how the subscriber keeps up with busy replicas)."""
        ...

    def resolve(self, stream: StreamId, engine_hashes: Sequence[int]) -> list[int | None]:
        """Block keys of engine hashes the stream holds; ``None`` for unknown ones."""
        ...

    def clear(self, stream: StreamId) -> None:
        """Forget the stream's blocks and reset its watermark to -1 (engine restart)."""
        ...

    def drop(self, stream: StreamId) -> None:
        """Forget the stream entirely (its blocks, watermark and registration)."""
        ...

    def streams(self) -> list[StreamId]:
        """Every stream the index holds state for, sorted."""
        ...

    def longest_prefix(
        self, keys: Sequence[int], streams: Iterable[StreamId]
    ) -> dict[StreamId, PrefixMatch]:
        """Per stream, the leading keys it holds, stopping at its first miss; every stream
        asked is answered, in the order asked."""
        ...

    def stats(self, stream: StreamId) -> StreamStats:
        """Counts and watermark of one stream (zeros and -1 for an unknown stream)."""
        ...

    def close(self) -> None:
        """Release connections. The index must not be used afterwards."""
        ...


@runtime_checkable
class StoreIdentity(Protocol):
    """An index that can tell whether its store still holds what was written to it.

    Both backends implement it (the contract suite checks them); it is a Protocol of its
    own so that wrappers of :class:`BlockIndex` that have no use for it need not pass it on.
    """

    def intact(self) -> bool:
        """False once the store lost its data since the last call (a Redis restarted
        empty, a FLUSHALL: every stream's blocks and watermark are gone); True otherwise,
        and from the first call, which adopts the store as it is. A call that returns
        False marks the store again, so the next returns True until the next loss. Raises
        :class:`IndexUnavailableError` when the store cannot be reached. The memory
        backend never loses its data."""
        ...


HeldRuns: TypeAlias = list[tuple[PrefixMatch, list[int]]]
"""Holders grouped by their match: ``(match, the indices in the streams asked of the
streams whose longest prefix it is)``; each holder in one run, runs in no particular order."""


@runtime_checkable
class HolderLookup(Protocol):
    """An index that answers a lookup with its holders alone, at a cost that follows them
    and the matched prefix rather than the streams asked (the memory backend). A Protocol
    of its own, as :class:`StoreIdentity`: every index answers :func:`prefix_holders`,
    through this call when it has it, else through :meth:`BlockIndex.longest_prefix`."""

    def holders(self, keys: Sequence[int], streams: Sequence[StreamId]) -> HeldRuns:
        """The ``streams`` (distinct) holding ``keys[0]``, by index, in runs of one match
        (:data:`HeldRuns`): what :meth:`BlockIndex.longest_prefix` answers for them; every
        other stream's match is :data:`NO_MATCH`."""
        ...


Holders = Callable[[Sequence[int], Sequence[StreamId]], HeldRuns]
"""``(keys, streams)`` → the holders among ``streams`` (:meth:`HolderLookup.holders`)."""


def holders_of(index: BlockIndex) -> Holders:
    """The index's :meth:`HolderLookup.holders` when it has one, else the same answer made
    from its :meth:`~BlockIndex.longest_prefix` (found once: callers keep it, as a wrapper
    passing the call on does)."""
    if isinstance(index, HolderLookup):
        return index.holders

    def holders(keys: Sequence[int], streams: Sequence[StreamId]) -> HeldRuns:
        found = index.longest_prefix(keys, streams)
        if len(found) == len(streams):  # distinct: the answer is in the order asked
            return [(match, [i]) for i, match in enumerate(found.values()) if match.tiers]
        return [(match, [i]) for i, s in enumerate(streams) if (match := found[s]).tiers]

    return holders


def prefix_holders(
    index: BlockIndex, keys: Sequence[int], streams: Sequence[StreamId]
) -> dict[StreamId, PrefixMatch]:
    """Each of ``streams`` that holds ``keys[0]`` → its longest prefix (every other one's is
    :data:`NO_MATCH`), on any index, through :func:`holders_of`."""
    return {streams[i]: match for match, run in holders_of(index)(keys, streams) for i in run}


def drop_replica(index: BlockIndex, replica: str) -> list[StreamId]:
    """Drop every stream (data-parallel rank) of a replica; returns the streams dropped."""
    dropped = [s for s in index.streams() if s.replica == replica]
    for stream in dropped:
        index.drop(stream)
    return dropped


class FencedError(KvIndexError):
    """A write refused because another indexer owns the stream now (its lease token is the
    stream's fence): nothing of the call was applied. The caller stops writing the stream."""
