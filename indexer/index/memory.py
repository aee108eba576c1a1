"""The in-process :class:`~kvindex.indexer.index.protocol.BlockIndex`: the embedded default.

Plain dicts guarded by one lock; the same semantics as the Redis backend, proven by the
shared contract suite.

A block's counts are one int, ``gpu + cpu * 2**32 + other * 2**64`` (Python ints do not
overflow), not a list: a GPU-only block's counts are then a cached small int, nothing is
allocated per store, and the dicts hold only ints, which the garbage collector does not
track (lists per block made its full collections walk every cached block).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvindex.indexer.events import StreamId, Tier
from kvindex.indexer.index.protocol import (
    NO_MATCH,
    SKIPPED,
    ApplyResult,
    BatchOps,
    Op,
    OpKind,
    PrefixMatch,
    StreamStats,
    applied,
)

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


@dataclass(slots=True)
class _Stream:
    key_to_counts: dict[int, int] = field(default_factory=dict)
    hash_to_key: dict[int, int] = field(default_factory=dict)
    blocks_by_tier: list[int] = field(default_factory=lambda: [0] * _NUM_TIERS)
    watermark: int = -1
    last_ts: float | None = None

    def reset(self) -> None:
        """Forget every block (in place: the hot loop holds references to these)."""
        self.key_to_counts.clear()
        self.hash_to_key.clear()
        self.blocks_by_tier[:] = [0] * _NUM_TIERS


class MemoryIndex:
    """In-process block index. Thread-safe; every call holds one lock briefly."""

    def __init__(self) -> None:
        self._streams: dict[StreamId, _Stream] = {}
        self._lock = threading.Lock()

    def apply(self, stream: StreamId, seq: int, ts: float, ops: Sequence[Op]) -> ApplyResult:
        return self.apply_many(stream, [(seq, ts, ops)])[0]

    def apply_many(self, stream: StreamId, batches: Sequence[BatchOps]) -> list[ApplyResult]:
        results: list[ApplyResult] = []
        with self._lock:
            state = self._streams.get(stream)
            if state is None:
                state = self._streams[stream] = _Stream()
            for seq, ts, ops in batches:
                if seq <= state.watermark:
                    results.append(SKIPPED)
                    continue
                unknown, unresolved = _apply_ops(state, ops)
                state.watermark = seq
                state.last_ts = ts
                results.append(applied(unknown, unresolved))
        return results

    def resolve(self, stream: StreamId, engine_hashes: Sequence[int]) -> list[int | None]:
        with self._lock:
            state = self._streams.get(stream)
            if state is None:
                return [None] * len(engine_hashes)
            get = state.hash_to_key.get
            return [get(h) for h in engine_hashes]

    def clear(self, stream: StreamId) -> None:
        with self._lock:
            state = self._streams.get(stream)
            if state is not None:
                state.reset()
                state.watermark = -1
                state.last_ts = None

    def drop(self, stream: StreamId) -> None:
        with self._lock:
            self._streams.pop(stream, None)

    def streams(self) -> list[StreamId]:
        with self._lock:
            return sorted(self._streams)

    def longest_prefix(
        self, keys: Sequence[int], streams: Iterable[StreamId]
    ) -> dict[StreamId, PrefixMatch]:
        result: dict[StreamId, PrefixMatch] = {}
        with self._lock:
            for stream in streams:
                state = self._streams.get(stream)
                result[stream] = NO_MATCH if state is None else _prefix(state, keys)
        return result

    def stats(self, stream: StreamId) -> StreamStats:
        with self._lock:
            state = self._streams.get(stream)
            if state is None:
                return StreamStats(stream, -1, None, dict.fromkeys(Tier, 0))
            by_tier = dict(zip(_TIERS, state.blocks_by_tier, strict=True))
            return StreamStats(stream, state.watermark, state.last_ts, by_tier)

    def intact(self) -> bool:
        """Always True: the data lives and dies with this process."""
        return True

    def close(self) -> None:
        pass


def _apply_ops(state: _Stream, ops: Sequence[Op]) -> tuple[int, int]:
    """The hot loop (inlined on purpose): returns (unknown removals, unresolved stores)."""
    hash_to_key = state.hash_to_key
    key_to_counts = state.key_to_counts
    get_counts = key_to_counts.get
    by_tier = state.blocks_by_tier
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
        if not (counts >> _SHIFT[tier]) & _LANE:
            by_tier[tier] += 1
        key_to_counts[key] = counts + _UNIT[tier]
    return unknown, unresolved


def _remove(state: _Stream, engine_hash: int, tier: int) -> bool:
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
            return True
    state.key_to_counts[key] = counts  # type: ignore[index]
    return True


def _prefix(state: _Stream, keys: Sequence[int]) -> PrefixMatch:
    by_tier = state.blocks_by_tier
    if not by_tier[_CPU] and not by_tier[_OTHER]:  # no block held on CPU nor OTHER
        return _gpu_prefix(state.key_to_counts, keys)
    tiers: list[Tier] = []
    append = tiers.append
    get = state.key_to_counts.get
    gpu = Tier.GPU
    for key in keys:
        counts = get(key)
        if counts is None:
            break
        append(gpu if counts & _LANE else _best_tier(counts))
    return PrefixMatch(tuple(tiers))


def _gpu_prefix(key_to_counts: dict[int, int], keys: Sequence[int]) -> PrefixMatch:
    """The prefix of a stream that holds blocks on GPU only (the common case): a held block
    has a non-zero count on some tier, here GPU, so no counts are read (a third faster: one
    cache miss less per block)."""
    num_blocks = 0
    for key in keys:
        if key not in key_to_counts:
            break
        num_blocks += 1
    return PrefixMatch(_ON_GPU * num_blocks)


def _best_tier(counts: int) -> Tier:
    for tier in _TIERS:
        if (counts >> _SHIFT[tier]) & _LANE:
            return tier
    raise AssertionError("a held block has a non-zero count on some tier")
