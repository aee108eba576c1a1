"""The in-process :class:`~kvindex.indexer.index.protocol.BlockIndex`, the embedded default: the
compiled ``native.Tables`` (per stream its blocks; per block key its holders) under one
:class:`IndexLock`, which a write hands to a waiting reader every :data:`HOLD_BLOCKS` blocks."""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from kvindex.indexer import native
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.index.protocol import (
    NO_MATCH,
    SKIPPED,
    ApplyResult,
    BatchOps,
    HeldRuns,
    OnGpu,
    Op,
    PrefixMatch,
    StreamStats,
    applied,
)

if TYPE_CHECKING:
    from kvindex.indexer.domain.health import NativeCounts
    from kvindex.indexer.native import _core as native_core
    from kvindex.indexer.native._core import KeyCache, NativeBatch

HOLD_BLOCKS = 2048
_HAND_OVER_S = 0.005  # longest a writer waits, lock released, for a waiter to take it

_TIERS = tuple(Tier)
_ON_GPU = (Tier.GPU,)
_GPU_MATCHES_BLOCKS = 1 << 18  # most blocks the all-GPU matches kept for reuse hold


class Tables(Protocol):
    """Every stream's blocks by stream number, and block → holders; not thread-safe."""

    def reset(self, number: int) -> None: ...

    def apply(self, number: int, ops: Sequence[Op]) -> tuple[int, int]:
        """Apply ops in order; returns (unknown removals, unresolved stores)."""
        ...

    def resolve(self, number: int, engine_hashes: Sequence[int]) -> list[int | None]: ...

    def blocks_by_tier(self, number: int) -> list[int]: ...

    def matched(self, keys: list[int]) -> list[tuple[int, int]]:
        """(bitmap of stream numbers, blocks they matched) per stream holding ``keys[0]``."""
        ...

    def best_tiers(self, number: int, keys: list[int], num_blocks: int) -> list[int]:
        """The best tier of each of the first ``num_blocks`` keys, all held by ``number``."""
        ...

    def split_holders(self, bitmap: int, index_of: list[int]) -> tuple[list[int], list[int]]:
        """``index_of[number]`` of the streams of ``bitmap`` holding blocks on GPU only, and
        the others' numbers, both ascending."""
        ...


class IndexLock:
    """A lock a long holder can hand over to a waiting thread (``threading.Lock`` is unfair)."""

    __slots__ = ("_lock", "_waiting")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[None] = []  # one item per blocked thread (append, pop: atomic)

    def __enter__(self) -> None:
        if not self._lock.acquire(False):
            self._waiting.append(None)
            try:
                self._lock.acquire()
            finally:
                self._waiting.pop()

    def __exit__(self, *_: object) -> None:
        self._lock.release()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def hand_over(self) -> bool:
        """If a thread waits, let it take the lock first, then take it back. True if handed
        over: the holder must read the state it kept again."""
        if not self._waiting:
            return False
        self._lock.release()
        self.let_waiters_in()
        self.__enter__()
        return True

    def let_waiters_in(self) -> None:
        """Called unlocked: a waiting thread takes the lock first (within :data:`_HAND_OVER_S`)."""
        deadline = time.monotonic() + _HAND_OVER_S
        while self._waiting and time.monotonic() < deadline:
            time.sleep(0)  # gives up the GIL too: the waiter needs it to return


@dataclass(slots=True)
class _Stream:
    stream: StreamId
    number: int  # unique among the index's live streams
    watermark: int = -1
    last_ts: float | None = None


@dataclass(frozen=True, slots=True)
class _Asked:
    streams: tuple[StreamId, ...]
    numbering: int
    no_matches: dict[StreamId, PrefixMatch]  # never changed: each answer is a copy
    wanted: int  # bitmap of the asked streams' numbers
    index_of: list[int]  # stream number → its index among those asked (-1: none)


class MemoryIndex:
    """In-process block index, thread-safe; ``tables`` default to the compiled ones."""

    def __init__(self, *, tables: Tables | None = None) -> None:
        self._tables = native.Tables() if tables is None else tables
        self.compiled = type(self._tables) is native.Tables
        self.native_ingest = self.compiled and type(self).apply_many is MemoryIndex.apply_many
        """Whether :meth:`apply_native` serves (not for a subclass overriding apply_many)."""
        self._streams: dict[StreamId, _Stream] = {}
        self._state_of: list[_Stream | None] = []  # by stream number (None: free)
        self._free: list[int] = []
        self._numbering = 0  # changes whenever a stream gets or gives up its number
        self._asked: _Asked | None = None  # the last lookup's streams, prepared
        self._gpu_matches: dict[int, PrefixMatch] = {}  # by length, reused across lookups
        self._gpu_blocks = 0
        self._lock = IndexLock()

    def _state(self, stream: StreamId) -> _Stream:
        state = self._streams.get(stream)
        if state is None:
            number = heapq.heappop(self._free) if self._free else len(self._state_of)
            state = self._streams[stream] = _Stream(stream, number)
            if number == len(self._state_of):
                self._state_of.append(state)
            else:
                self._state_of[number] = state
            self._numbering += 1
        return state

    def apply(self, stream: StreamId, seq: int, ts: float, ops: Sequence[Op]) -> ApplyResult:
        return self.apply_many(stream, [(seq, ts, ops)])[0]

    def apply_many(self, stream: StreamId, batches: Sequence[BatchOps]) -> list[ApplyResult]:
        """Each batch atomically, in order; the lock handed over every :data:`HOLD_BLOCKS` ops."""
        results: list[ApplyResult] = []
        apply = self._tables.apply
        with self._lock:
            state = self._state(stream)
            held = 0
            for seq, ts, ops in batches:
                if held >= HOLD_BLOCKS:
                    held = 0
                    if self._lock.hand_over():
                        state = self._state(stream)  # it may have been cleared or dropped
                if seq <= state.watermark:
                    results.append(SKIPPED)
                    continue
                unknown, unresolved = apply(state.number, ops)
                held += len(ops)
                state.watermark = seq
                state.last_ts = ts
                results.append(applied(unknown, unresolved))
        return results

    def apply_native(
        self, stream: StreamId, batches: list[NativeBatch], cache: KeyCache, root: int
    ) -> NativeCounts:
        """``Ingestor.apply_many`` compiled: per piece, keys chained unlocked, applied locked."""
        tables: native_core.Tables = self._tables  # type: ignore[assignment]
        pieces = _pieces(batches) if len(batches) > 1 else [batches]
        totals = [0] * 9 + [-1]
        for piece in pieces:
            cache.translate(piece, root)
            with self._lock:
                state = self._state(stream)
                out = tables.ingest(state.number, piece, cache, root, state.watermark)
                state.watermark = out[0]
                if out[1] is not None:
                    state.last_ts = out[1]
            if len(pieces) == 1:
                return out[2:]
            _add_counts(totals, out[2:])
            self._lock.let_waiters_in()  # a lock released is not handed over: Lock is unfair
        return tuple(totals)  # type: ignore[return-value]  # ten ints: NativeCounts

    def resolve(self, stream: StreamId, engine_hashes: Sequence[int]) -> list[int | None]:
        with self._lock:
            state = self._streams.get(stream)
            if state is None:
                return [None] * len(engine_hashes)
            return self._tables.resolve(state.number, engine_hashes)

    def clear(self, stream: StreamId) -> None:
        with self._lock:
            state = self._streams.get(stream)
            if state is not None:
                self._tables.reset(state.number)
                state.watermark = -1
                state.last_ts = None

    def drop(self, stream: StreamId) -> None:
        with self._lock:
            state = self._streams.pop(stream, None)
            if state is not None:
                self._tables.reset(state.number)
                self._state_of[state.number] = None
                self._numbering += 1
                heapq.heappush(self._free, state.number)

    def streams(self) -> list[StreamId]:
        with self._lock:
            return sorted(self._streams)

    def longest_prefix(
        self, keys: Sequence[int], streams: Iterable[StreamId]
    ) -> dict[StreamId, PrefixMatch]:
        asked = tuple(streams)
        keys = keys if type(keys) is list else list(keys)
        with self._lock:
            memo = self._asked_for(asked)
            result = memo.no_matches.copy()
            for match, run in self._held(keys, memo):
                for i in run:
                    result[asked[i]] = match
        return result

    def holders(self, keys: Sequence[int], streams: Sequence[StreamId]) -> HeldRuns:
        asked = tuple(streams)  # the same tuple when given one: no copy
        keys = keys if type(keys) is list else list(keys)
        with self._lock:
            return self._held(keys, self._asked_for(asked))

    def _held(self, keys: list[int], asked: _Asked) -> HeldRuns:
        if not self.compiled:
            return self._held_reference(keys, asked)
        tables: native_core.Tables = self._tables  # type: ignore[assignment]
        return tables.held(
            keys, asked.wanted, asked.index_of, self._gpu_matches, self._on_gpu, _mixed_match
        )

    def _held_reference(self, keys: list[int], asked: _Asked) -> HeldRuns:
        """The holders of ``keys``' prefixes among those ``asked``, run by run (locked)."""
        runs: HeldRuns = []
        tables, index_of, wanted = self._tables, asked.index_of, asked.wanted
        for leavers, num_blocks in tables.matched(keys):
            if not (asked_leavers := leavers & wanted):
                continue
            on_gpu, mixed = tables.split_holders(asked_leavers, index_of)
            if on_gpu:
                runs.append((self._on_gpu(num_blocks), on_gpu))
            for number in mixed:
                tiers = tables.best_tiers(number, keys, num_blocks)
                runs.append((_mixed_match(tiers), [index_of[number]]))
        return runs

    def _on_gpu(self, num_blocks: int) -> PrefixMatch:
        """An all-GPU match of ``num_blocks``, one object per length (called locked)."""
        match = self._gpu_matches.get(num_blocks)
        if match is None:
            if self._gpu_blocks + num_blocks > _GPU_MATCHES_BLOCKS:
                self._gpu_matches.clear()
                self._gpu_blocks = 0
            match = self._gpu_matches[num_blocks] = PrefixMatch(OnGpu(_ON_GPU * num_blocks))
            self._gpu_blocks += num_blocks
        return match

    def _asked_for(self, streams: tuple[StreamId, ...]) -> _Asked:
        """The prepared lookup of ``streams``: the last call's while nothing changed."""
        last = self._asked
        if last is not None and last.numbering == self._numbering:
            if last.streams is streams:
                return last
            if last.streams == streams:  # a caller's new tuple: kept, so its next call is an `is`
                self._asked = replace(last, streams=streams)
                return self._asked
        wanted = 0
        index_of = [-1] * len(self._state_of)
        for i, stream in enumerate(streams):
            state = self._streams.get(stream)
            if state is not None:
                wanted |= 1 << state.number
                index_of[state.number] = i
        no_matches = dict.fromkeys(streams, NO_MATCH)
        self._asked = _Asked(streams, self._numbering, no_matches, wanted, index_of)
        return self._asked

    def stats(self, stream: StreamId) -> StreamStats:
        with self._lock:
            state = self._streams.get(stream)
            if state is None:
                return StreamStats(stream, -1, None, dict.fromkeys(Tier, 0))
            counts = self._tables.blocks_by_tier(state.number)
            by_tier = dict(zip(_TIERS, counts, strict=True))
            return StreamStats(stream, state.watermark, state.last_ts, by_tier)

    def intact(self) -> bool:
        return True

    def close(self) -> None:
        pass


def _mixed_match(tiers: list[int]) -> PrefixMatch:
    return PrefixMatch(tuple(map(Tier, tiers)))


def _pieces(batches: list[NativeBatch]) -> list[list[NativeBatch]]:
    pieces: list[list[NativeBatch]] = []
    start = num_blocks = 0
    for i, batch in enumerate(batches):
        num_blocks += batch.num_blocks
        if num_blocks >= HOLD_BLOCKS:
            pieces.append(batches[start : i + 1])
            start, num_blocks = i + 1, 0
    if start < len(batches):
        pieces.append(batches[start:])
    return pieces


def _add_counts(totals: list[int], counts: tuple[int, ...]) -> None:
    """Add one piece's ``NativeCounts``: sums, but the last store's block size is the latest."""
    for i in range(9):
        totals[i] += counts[i]
    if counts[9] >= 0:
        totals[9] = counts[9]
