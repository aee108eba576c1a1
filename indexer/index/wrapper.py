"""``IndexWrapper``: a :class:`~kvindex.indexer.index.protocol.BlockIndex` around another, every
call forwarded unchanged, so a wrapper (a circuit, a journal, timings) overrides only what it
changes. A subclass of the Protocol itself: mypy checks each override's signature against it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.index.protocol import (
    ApplyResult,
    BatchOps,
    BlockIndex,
    HeldRuns,
    Op,
    PrefixMatch,
    StoreIdentity,
    StreamStats,
    holders_of,
)


class IndexWrapper(BlockIndex):
    """Forwards every :class:`BlockIndex` call, :meth:`holders` (the inner index's own lookup
    when it has one) and :meth:`intact` (True when the inner index cannot tell) to ``inner``;
    thread-safe as ``inner`` is."""

    def __init__(self, inner: BlockIndex) -> None:
        self._inner = inner
        self._holders = holders_of(inner)

    def apply(self, stream: StreamId, seq: int, ts: float, ops: Sequence[Op]) -> ApplyResult:
        return self._inner.apply(stream, seq, ts, ops)

    def apply_many(self, stream: StreamId, batches: Sequence[BatchOps]) -> list[ApplyResult]:
        return self._inner.apply_many(stream, batches)

    def resolve(self, stream: StreamId, engine_hashes: Sequence[int]) -> list[int | None]:
        return self._inner.resolve(stream, engine_hashes)

    def clear(self, stream: StreamId) -> None:
        self._inner.clear(stream)

    def drop(self, stream: StreamId) -> None:
        self._inner.drop(stream)

    def streams(self) -> list[StreamId]:
        return self._inner.streams()

    def longest_prefix(
        self, keys: Sequence[int], streams: Iterable[StreamId]
    ) -> dict[StreamId, PrefixMatch]:
        return self._inner.longest_prefix(keys, streams)

    def holders(self, keys: Sequence[int], streams: Sequence[StreamId]) -> HeldRuns:
        return self._holders(keys, streams)

    def stats(self, stream: StreamId) -> StreamStats:
        return self._inner.stats(stream)

    def intact(self) -> bool:
        inner = self._inner
        return inner.intact() if isinstance(inner, StoreIdentity) else True

    def close(self) -> None:
        self._inner.close()
