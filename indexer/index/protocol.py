"""The block index Protocol and its types; every backend (``tests/contract``) holds, per stream:
a batch is atomic with the watermark (exact last seq) and a no-op at or below it, a longest prefix
stops at the first miss, clearing costs the stream's own blocks, never a scan."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias, runtime_checkable

from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.events import StreamId, Tier

MAX_SEQ = 2**64  # the wire's 8-byte unsigned counter


class IndexUnavailableError(KvIndexError):
    """The index store cannot be reached (e.g. Redis is down); retry later."""


class OpKind(enum.IntEnum):
    """Index operations (values stable: the Redis script reads them); STORE_BY_HASH: tokenless."""

    STORE = 0
    STORE_BY_HASH = 1
    REMOVE = 2
    CLEAR = 3


Op: TypeAlias = tuple[OpKind, Tier, int, int]
"""``(kind, tier, engine_hash, key)``; fields an op does not use are 0."""

BatchOps: TypeAlias = tuple[int, float, Sequence[Op]]
"""One batch ready for the index: ``(seq, engine ts, ops)``."""


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """What applying one batch did, with what it could not (counted)."""

    applied: bool
    num_unknown_removals: int = 0
    num_unresolved_stores: int = 0


SKIPPED = ApplyResult(applied=False)
APPLIED = ApplyResult(applied=True)  # the common case: shared, not allocated


def applied(num_unknown_removals: int, num_unresolved_stores: int) -> ApplyResult:
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


class OnGpu(tuple[Tier, ...]):
    """A match's tiers known to be all GPU (the common case): counted without a scan."""

    __slots__ = ()


def gpu_count(tiers: Sequence[Tier]) -> int:
    """How many of ``tiers`` are on GPU (an :class:`OnGpu` by its length)."""
    return len(tiers) if type(tiers) is OnGpu else tiers.count(Tier.GPU)


@dataclass(frozen=True, slots=True)
class StreamStats:
    stream: StreamId
    watermark: int
    """Last applied seq; -1 before the first batch (or after a restart cleared it)."""
    last_event_ts: float | None  # the engine's ts of the last applied batch
    blocks_by_tier: dict[Tier, int] = field(default_factory=dict)  # distinct blocks per tier

    @property
    def num_blocks(self) -> int:
        return sum(self.blocks_by_tier.values())


class BlockIndex(Protocol):
    """Where every cached block lives. Implementations are safe to call from any thread."""

    def apply(self, stream: StreamId, seq: int, ts: float, ops: Sequence[Op]) -> ApplyResult:
        """Atomically with the watermark; ``seq`` ≤ watermark is a no-op."""
        ...

    def apply_many(self, stream: StreamId, batches: Sequence[BatchOps]) -> list[ApplyResult]:
        """Consecutive batches of one stream, in order, each as :meth:`apply`."""
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
        """Per stream asked, in order: the leading keys it holds, up to its first miss."""
        ...

    def stats(self, stream: StreamId) -> StreamStats:
        """Counts and watermark of one stream (zeros and -1 for an unknown stream)."""
        ...

    def close(self) -> None:
        """Release connections; the index must not be used afterwards."""
        ...


@runtime_checkable
class StoreIdentity(Protocol):
    """An index that can tell whether its store still holds what was written to it."""

    def intact(self) -> bool:
        """False once the store lost its data since the last call; the first call adopts it."""
        ...


HeldRuns: TypeAlias = list[tuple[PrefixMatch, list[int]]]
"""``(match, indices in the streams asked of those it is the longest prefix of)``, any order."""


@runtime_checkable
class HolderLookup(Protocol):
    """An index whose lookup cost follows the holders, not the streams asked."""

    def holders(self, keys: Sequence[int], streams: Sequence[StreamId]) -> HeldRuns:
        """The ``streams`` (distinct) holding ``keys[0]``, as :meth:`BlockIndex.longest_prefix`."""
        ...


Holders = Callable[[Sequence[int], Sequence[StreamId]], HeldRuns]  # HolderLookup.holders


def holders_of(index: BlockIndex) -> Holders:
    """The index's :meth:`HolderLookup.holders`, else the same from ``longest_prefix``."""
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
    return {streams[i]: match for match, run in holders_of(index)(keys, streams) for i in run}


def drop_replica(index: BlockIndex, replica: str) -> list[StreamId]:
    dropped = [s for s in index.streams() if s.replica == replica]
    for stream in dropped:
        index.drop(stream)
    return dropped


class FencedError(KvIndexError):
    """A write refused, nothing applied: another indexer owns the stream now."""
