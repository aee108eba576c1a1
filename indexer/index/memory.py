"""The in-process :class:`~kvindex.indexer.index.protocol.BlockIndex`: the embedded default.

One lock over the index's tables; the same semantics as the Redis backend, proven by the
shared contract suite. The tables are compiled (``kvindex.indexer.native``: open-addressing
arrays of 64-bit keys and values, about 16 bytes a slot where a dict of ints costs 100+)
when the extension is built, else :class:`PyTables` (plain dicts), the reference the tests
hold the compiled tables to. :class:`MemoryIndex` keeps what is per stream and small (its
number, watermark, last timestamp); the tables keep the blocks, by stream number.

What a lookup costs: the prompt's blocks up to the longest match (over every stream), plus
each holder's own answer, never the streams that hold nothing. Besides each stream's own
maps, the tables keep one map block key → its holders, every stream having a small number of
its own: a block held by one stream maps to that number (nothing allocated for the common
private block), one held by several to a bitmap of their numbers. ``Tables.matched`` walks
the prompt once, ANDing the holders of each block into the set still matching (a compare,
no new int, where a block's holders are those of the block before), and stops when it is
empty; a stream that leaves the set at block ``i`` matched ``i`` blocks. Once a single
stream is left, the walk goes on in that stream's own map (small, so in cache; the
fleet-wide map misses the cache at a million blocks). So 1,024 replicas of which 256 share a
64-block system prompt cost 64 bitmap compares and 256 answers, not 1,024 walks of up to 65
reads each. :meth:`MemoryIndex.holders` answers those alone: per set of streams leaving at
one block, one shared match and the list of their indices among the streams asked
(``Tables.split_holders``: one C pass over the bitmap's bytes), so a lookup of 1,024 streams
makes nothing for the 768 that hold nothing. :meth:`MemoryIndex.longest_prefix` adds them
as a copy of a prepared no-match answer (C, no stream hashed). Both keep the numbers' bitmap
and each number's index while the streams asked (the same tuple, or equal) and the
numbering stay the same.

The map is kept in step with the streams' own maps: a block joins it when a stream's
counts for it go from nothing to something and leaves when they go back (a removal, a
clear, a drop: the cost of that stream's own blocks). Numbers freed by a drop are reused,
so bitmaps stay as wide as the fleet, not as its history.

Locking: one lock (:class:`IndexLock`) over the tables, taken by every call. The compiled
ingest (``Tables.ingest``) runs without the GIL while it holds it, so while one thread
applies, others run Python (decoding the next frames, answering HTTP) until they need the
index. Its pure part runs before, without the lock (``KeyCache.translate``: the keys of
each block whose parent is in the stream's own key cache, chained while another ingest
worker applies): about a quarter of the compiled ingest on batches of chained stores, next
to nothing where parents are found in the index (prefix hits with the memory store's
default key cache of 0), as the translation stops at the first such parent. A write holds
the lock for at most :data:`HOLD_BLOCKS` blocks at a time (whole batches: each stays
atomic) and then lets a thread waiting for it in first: a backlog of thousands of messages
used to keep the API's lookup waiting for the whole drain (``threading.Lock`` is unfair: a
thread that releases and takes it again at once nearly always wins), about 250 ms; now it
waits for one piece (README, Performance). The compiled path releases the lock between two
pieces anyway, to translate the next one.

In :class:`PyTables` a block's counts are one int, ``gpu + cpu * 2**32 + other * 2**64``
(Python ints do not overflow), not a list: a GPU-only block's counts are then a cached small
int, nothing is allocated per store, and the dicts hold only ints, which the garbage
collector does not track. The compiled tables pack them in 21 bits a tier (a count
saturates at 2**21 - 1 stores of one block without a removal, which no engine makes).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvindex.indexer import native
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.index.protocol import (
    NO_MATCH,
    SKIPPED,
    ApplyResult,
    BatchOps,
    HeldRuns,
    Op,
    OpKind,
    PrefixMatch,
    StreamStats,
    applied,
)

_set_bits: Callable[[int], list[int]] | None = None
"""The compiled :func:`_numbers` (None: not built, the Python one serves)."""
try:
    from kvindex.indexer.native import _lookup
except ImportError:
    pass
else:
    _set_bits = _lookup.set_bits

if TYPE_CHECKING:
    from kvindex.indexer.domain.health import NativeCounts
    from kvindex.indexer.domain.keys import KeyCache
    from kvindex.indexer.native import _core as native_core
    from kvindex.indexer.native._core import NativeBatch

HOLD_BLOCKS = 2048
"""Blocks (ops) a write applies per hold of the index lock before it lets a waiting thread
in: about 1-3 ms of the compiled ingest on this machine (whole batches: a larger one is
applied in one hold)."""
_HAND_OVER_S = 0.005
"""Longest a writer waits, lock released, for the thread that waits for it to take it."""

_NUM_TIERS = len(Tier)
_LANE_BITS = 32
_LANE = (1 << _LANE_BITS) - 1
_UNIT = tuple(1 << (_LANE_BITS * t) for t in range(_NUM_TIERS))
"""What one more block on a tier adds to a block's packed counts."""
_SHIFT = tuple(_LANE_BITS * t for t in range(_NUM_TIERS))
_STORE, _STORE_BY_HASH, _REMOVE = int(OpKind.STORE), int(OpKind.STORE_BY_HASH), int(OpKind.REMOVE)
_TIERS = tuple(Tier)
_CPU, _OTHER = int(Tier.CPU), int(Tier.OTHER)
_ON_GPU = (Tier.GPU,)


class Tables(Protocol):
    """The blocks of every stream of one index, by stream number, and the block → holders
    map. Not thread-safe (the index locks). Implemented by :class:`PyTables` and by the
    compiled ``kvindex.indexer.native.Tables``; the tests hold them to the same answers."""

    def reset(self, number: int) -> None:
        """Forget every block of stream ``number`` (and its place among their holders)."""

    def apply(self, number: int, ops: Sequence[Op]) -> tuple[int, int]:
        """Apply ops in order; returns (unknown removals, unresolved stores)."""
        ...

    def resolve(self, number: int, engine_hashes: Sequence[int]) -> list[int | None]: ...

    def blocks_by_tier(self, number: int) -> list[int]: ...

    def matched(self, keys: list[int]) -> list[tuple[int, int]]:
        """(bitmap of stream numbers, blocks they matched) for every stream holding
        ``keys[0]``."""
        ...

    def best_tiers(self, number: int, keys: list[int], num_blocks: int) -> list[int]:
        """The best tier of each of the first ``num_blocks`` keys (stream ``number`` holds
        them all)."""
        ...

    def split_holders(self, bitmap: int, index_of: list[int]) -> tuple[list[int], list[int]]:
        """``(index_of[number] of each stream number of bitmap holding blocks on GPU only,
        the numbers of the others)``, both ascending by number."""
        ...


@dataclass(slots=True)
class _Blocks:
    """One stream's blocks in :class:`PyTables`."""

    number: int
    """Its bit in the holder bitmaps (unique among the index's live streams)."""
    holders: dict[int, int]
    """The tables' block key → holders map (shared by every stream)."""
    key_to_counts: dict[int, int] = field(default_factory=dict)
    hash_to_key: dict[int, int] = field(default_factory=dict)
    blocks_by_tier: list[int] = field(default_factory=lambda: [0] * _NUM_TIERS)

    def reset(self) -> None:
        """Forget every block (in place: the hot loop holds references to these)."""
        holders, number = self.holders, self.number
        for key in self.key_to_counts:
            _release(holders, key, number)
        self.key_to_counts.clear()
        self.hash_to_key.clear()
        self.blocks_by_tier[:] = [0] * _NUM_TIERS


class PyTables:
    """:class:`Tables` in plain dicts: the reference, and the fallback when the compiled
    extension is not built. ``holders`` maps a block key to ``~number`` of its one holder
    (a negative int: nothing allocated for the common private block) or the bitmap of its
    holders' numbers."""

    def __init__(self) -> None:
        self.holders: dict[int, int] = {}
        self._blocks: list[_Blocks] = []

    def _of(self, number: int) -> _Blocks:
        while number >= len(self._blocks):
            self._blocks.append(_Blocks(len(self._blocks), self.holders))
        return self._blocks[number]

    def reset(self, number: int) -> None:
        self._of(number).reset()

    def apply(self, number: int, ops: Sequence[Op]) -> tuple[int, int]:
        return _apply_ops(self._of(number), ops)

    def resolve(self, number: int, engine_hashes: Sequence[int]) -> list[int | None]:
        get = self._of(number).hash_to_key.get
        return [get(h) for h in engine_hashes]

    def blocks_by_tier(self, number: int) -> list[int]:
        return list(self._of(number).blocks_by_tier)

    def matched(self, keys: list[int]) -> list[tuple[int, int]]:
        return list(_matched(self.holders, keys, self._blocks))

    def best_tiers(self, number: int, keys: list[int], num_blocks: int) -> list[int]:
        counts_of = self._of(number).key_to_counts
        return [_best_tier(counts_of[key]) for key in keys[:num_blocks]]

    def split_holders(self, bitmap: int, index_of: list[int]) -> tuple[list[int], list[int]]:
        indices, mixed = [], []
        for number in _numbers(bitmap):
            _, on_cpu, on_other = self._of(number).blocks_by_tier
            if on_cpu or on_other:
                mixed.append(number)
            else:
                indices.append(index_of[number])
        return indices, mixed


def new_tables(*, compiled: bool = True) -> Tables:
    """The compiled tables when asked for and built, else :class:`PyTables`."""
    if compiled and native.Tables is not None:
        return native.Tables()
    return PyTables()


def _joined(holders: int, number: int) -> int:
    """The holders of a block once stream ``number`` (not yet one of them) holds it too."""
    if holders < 0:
        return (1 << ~holders) | (1 << number)
    return holders | (1 << number)


def _release(holders: dict[int, int], key: int, number: int) -> None:
    """Stream ``number`` no longer holds ``key``: drop its bit (a lone holder: the entry)."""
    if (held := holders.pop(key)) >= 0:
        _put_back(holders, key, held, number)


def _put_back(holders: dict[int, int], key: int, bitmap: int, number: int) -> None:
    """Put back ``key``'s entry (just popped: the bitmap of several holders) without stream
    ``number``; one holder left takes its compact form."""
    bitmap &= ~(1 << number)
    holders[key] = bitmap if bitmap & (bitmap - 1) else ~(bitmap.bit_length() - 1)


def _bitmap(held: int) -> int:
    return (1 << ~held) if held < 0 else held


class IndexLock:
    """A lock that a long holder can hand over: ``with lock:`` as with ``threading.Lock``,
    and :meth:`hand_over` between two pieces of a long write lets a thread that waits for
    the lock take it first. Its cost where nobody waits: one failed-or-not non-blocking
    acquire more per ``with`` (the waiters are announced only by threads that find it
    taken) and one list length per hand-over."""

    __slots__ = ("_lock", "_waiting")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[None] = []
        """One item per thread blocked on the lock (append and pop are atomic)."""

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
        """Threads blocked on the lock now."""
        return len(self._waiting)

    def hand_over(self) -> bool:
        """Held by the caller: if a thread waits, release the lock until it has it (or
        :data:`_HAND_OVER_S` passed), then take it back (after that thread's hold). True
        if it was handed over: the holder must read the state it kept again."""
        if not self._waiting:
            return False
        self._lock.release()
        deadline = time.monotonic() + _HAND_OVER_S
        while self._waiting and time.monotonic() < deadline:
            time.sleep(0)  # gives up the GIL too: the waiter needs it to return
        self.__enter__()
        return True


@dataclass(slots=True)
class _Stream:
    stream: StreamId
    number: int
    """Its number in the tables (unique among the index's live streams)."""
    watermark: int = -1
    last_ts: float | None = None


@dataclass(frozen=True, slots=True)
class _Asked:
    streams: tuple[StreamId, ...]
    numbering: int
    no_matches: dict[StreamId, PrefixMatch]
    """Never changed: each answer is a copy."""
    wanted: int
    """Bitmap of the numbers of the streams the index holds state for."""
    index_of: list[int]
    """Stream number → the index of its stream among those asked (-1: not asked, free)."""


class MemoryIndex:
    """In-process block index. Thread-safe; every call holds one lock briefly.

    ``compiled=False`` keeps the blocks in :class:`PyTables` even when the extension is
    built (the tests run the contract suite on both); :attr:`compiled` says which serve.
    """

    def __init__(self, *, compiled: bool = True) -> None:
        self._tables = new_tables(compiled=compiled)
        self.compiled = not isinstance(self._tables, PyTables)
        self.native_ingest = (
            self.compiled
            and native.NativeBatch is not None
            and type(self).apply_many is MemoryIndex.apply_many
        )
        """Whether :meth:`apply_native` serves (the compiled tables and ingest path). Not
        for a subclass that overrides :meth:`apply_many` (to wrap or fail writes): every
        write then still goes through it."""
        self._streams: dict[StreamId, _Stream] = {}
        self._state_of: list[_Stream | None] = []
        """Stream number → the stream's state (None: free, listed in ``_free``)."""
        self._free: list[int] = []
        self._numbering = 0
        """Changes whenever a stream gets or gives up its number."""
        self._asked: _Asked | None = None
        """The streams of the last lookup, their answer with no match and their numbers."""
        self._lock = IndexLock()

    def _state(self, stream: StreamId) -> _Stream:
        """The stream's state, created (with the lowest free number) on first use."""
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
        """Each batch atomically, in order; the lock is handed over to a waiting thread
        after every :data:`HOLD_BLOCKS` ops (between batches)."""
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
        """Translate and apply live batches decoded for the compiled ingest path (only when
        :attr:`native_ingest`): what ``Ingestor.apply_many`` and :meth:`apply_many` do for
        the same events, in compiled code; returns its counts. In pieces of about
        :data:`HOLD_BLOCKS` blocks, each in two phases, the GIL released in both: the
        keys chained from the cache alone (``native.KeyCache.translate``) without the lock,
        so another ingest worker applies meanwhile; then, under the lock, the rest
        translated (from a store whose parent only the index may know) and all applied
        (``native.Tables.ingest``). A clear or a drop of the stream between the two
        changes nothing of the first: it reads and fills the stream's cache alone, which
        only its worker's thread touches (see ``KeyCache.translate``)."""
        tables: native_core.Tables = self._tables  # type: ignore[assignment]
        own_cache: native_core.KeyCache = cache  # type: ignore[assignment]
        pieces = _pieces(batches) if len(batches) > 1 else [batches]
        totals = [0] * 9 + [-1]
        for piece in pieces:
            own_cache.translate(piece, root)
            with self._lock:
                state = self._state(stream)
                out = tables.ingest(state.number, piece, cache, root, state.watermark)
                state.watermark = out[0]
                if out[1] is not None:
                    state.last_ts = out[1]
            if len(pieces) == 1:
                return out[2:]
            _add_counts(totals, out[2:])
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
        """:meth:`longest_prefix`'s holders by index
        (:class:`~kvindex.indexer.index.protocol.HolderLookup`): nothing made per stream
        asked, so the cost follows the holders and the matched prefix alone."""
        asked = tuple(streams)  # the same tuple when given one: no copy
        keys = keys if type(keys) is list else list(keys)
        with self._lock:
            return self._held(keys, self._asked_for(asked))

    def _held(self, keys: list[int], asked: _Asked) -> HeldRuns:
        """The asked streams holding ``keys[0]``, by index, in runs of one match: per set
        of streams leaving the match at one block, one shared answer for those on GPU only
        (their indices collected in compiled code when built), the tiers read for the
        others."""
        runs: HeldRuns = []
        tables, index_of, wanted = self._tables, asked.index_of, asked.wanted
        for leavers, num_blocks in tables.matched(keys):
            if not (asked_leavers := leavers & wanted):
                continue
            on_gpu, mixed = tables.split_holders(asked_leavers, index_of)
            if on_gpu:
                runs.append((PrefixMatch(_ON_GPU * num_blocks), on_gpu))
            for number in mixed:
                tiers = tables.best_tiers(number, keys, num_blocks)
                runs.append((PrefixMatch(tuple(map(Tier, tiers))), [index_of[number]]))
        return runs

    def _asked_for(self, streams: tuple[StreamId, ...]) -> _Asked:
        """``NO_MATCH`` for each stream (to be copied), the bitmap of their numbers and
        each number's index among them: the last call's when the streams and the numbering
        are the same (the API asks for the same tuple each time: the same object, or
        compared by identity of its items, no stream hashed)."""
        last = self._asked
        if (
            last is not None
            and last.numbering == self._numbering
            and (last.streams is streams or last.streams == streams)
        ):
            return last
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
        """Always True: the data lives and dies with this process."""
        return True

    def close(self) -> None:
        pass


def _pieces(batches: list[NativeBatch]) -> list[list[NativeBatch]]:
    """Consecutive runs of ``batches`` of about :data:`HOLD_BLOCKS` blocks each (a batch
    larger than that is a run of its own)."""
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
    """Add one piece's :data:`~kvindex.indexer.ingest.ingestor.NativeCounts` to ``totals``: sums,
    but the last store's block size is the latest one seen (-1: none)."""
    for i in range(9):
        totals[i] += counts[i]
    if counts[9] >= 0:
        totals[9] = counts[9]


def _apply_ops(state: _Blocks, ops: Sequence[Op]) -> tuple[int, int]:
    """The hot loop (inlined on purpose): returns (unknown removals, unresolved stores)."""
    hash_to_key = state.hash_to_key
    key_to_counts = state.key_to_counts
    get_counts = key_to_counts.get
    by_tier = state.blocks_by_tier
    holders = state.holders
    join = holders.setdefault
    number, alone = state.number, ~state.number
    unknown = unresolved = 0
    for kind, tier, engine_hash, op_key in ops:
        if kind == _REMOVE:
            if not _remove(state, engine_hash, tier):
                unknown += 1
            continue
        if kind == _STORE:
            key = hash_to_key[engine_hash] = op_key
        elif kind == _STORE_BY_HASH:
            found = hash_to_key.get(engine_hash)
            if found is None:
                unresolved += 1
                continue
            key = found
        else:
            state.reset()
            continue
        counts = get_counts(key, 0)
        # New to the stream: it joins the block's holders (one C call for a block no other
        # stream holds: it cannot map to ``alone`` already, this stream did not hold it).
        if not counts and (held := join(key, alone)) != alone:
            holders[key] = _joined(held, number)
        if not (counts >> _SHIFT[tier]) & _LANE:
            by_tier[tier] += 1
        key_to_counts[key] = counts + _UNIT[tier]
    return unknown, unresolved


def _remove(state: _Blocks, engine_hash: int, tier: int) -> bool:
    """Count a block once less on a tier; False (nothing changes) if it is not held there."""
    key = state.hash_to_key.get(engine_hash)
    counts = 0 if key is None else state.key_to_counts.get(key, 0)
    held = (counts >> _SHIFT[tier]) & _LANE
    if not held:
        return False
    counts -= _UNIT[tier]
    if held == 1:
        state.blocks_by_tier[tier] -= 1
        if not counts:
            del state.key_to_counts[key]  # type: ignore[arg-type]
            del state.hash_to_key[engine_hash]
            if (others := state.holders.pop(key)) >= 0:  # type: ignore[arg-type]  # not alone
                _put_back(state.holders, key, others, state.number)  # type: ignore[arg-type]
            return True
    state.key_to_counts[key] = counts  # type: ignore[index]
    return True


def _matched(
    holders: dict[int, int], keys: Sequence[int], blocks: list[_Blocks]
) -> Iterator[tuple[int, int]]:
    """(bitmap of stream numbers, blocks they matched) for every stream holding ``keys[0]``:
    the prompt is walked once, the set still matching narrowed block by block until empty.
    Once one stream is left, the walk goes on in that stream's own (small, cached) dict
    rather than in the map of every block of the fleet."""
    if not keys or (first := holders.get(keys[0])) is None:
        return
    matching = _bitmap(first)
    holders_of = holders.get
    num_blocks = 1
    while num_blocks < len(keys) and matching & (matching - 1):
        held = holders_of(keys[num_blocks])
        still = 0 if held is None else matching & ((1 << ~held) if held < 0 else held)
        if still != matching:
            yield matching ^ still, num_blocks
            if not still:
                return
            matching = still
        num_blocks += 1
    if num_blocks < len(keys) and not matching & (matching - 1):
        key_to_counts = blocks[matching.bit_length() - 1].key_to_counts
        num_blocks = _held_from(key_to_counts, keys, num_blocks)
    yield matching, num_blocks


def _held_from(key_to_counts: dict[int, int], keys: Sequence[int], start: int) -> int:
    """How many leading keys a stream holds, knowing it holds the first ``start``."""
    for num_blocks in range(start, len(keys)):
        if keys[num_blocks] not in key_to_counts:
            return num_blocks
    return len(keys)


def _numbers(bitmap: int) -> Iterable[int]:
    """The set bits of a bitmap, ascending: compiled when built (one pass over its bytes),
    else :func:`_py_numbers`."""
    if _set_bits is not None:
        return _set_bits(bitmap)
    return _py_numbers(bitmap)


def _py_numbers(bitmap: int) -> Iterator[int]:
    """:func:`_numbers` in Python (C string scans: a bit operation on a wide int would
    allocate a new one per bit)."""
    if not bitmap & (bitmap - 1):  # none or one
        if bitmap:
            yield bitmap.bit_length() - 1
        return
    bits = bin(bitmap)[:1:-1]  # bit i at index i
    number = bits.find("1")
    while number >= 0:
        yield number
        number = bits.find("1", number + 1)


def _best_tier(counts: int) -> int:
    for tier in range(_NUM_TIERS):
        if (counts >> _SHIFT[tier]) & _LANE:
            return tier
    raise AssertionError("a held block has a non-zero count on some tier")
