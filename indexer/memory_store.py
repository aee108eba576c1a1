"""The in-process :class:`~indexer.index.BlockIndex`: the embedded default for one process.

Plain dicts guarded by one lock; the same semantics as the Redis backend, proven by the
shared contract suite.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from indexer.events import StreamId, Tier
from indexer.index import (
    NO_MATCH,
    SKIPPED,
    ApplyResult,
    Op,
    OpKind,
    PrefixMatch,
    StreamStats,
)

_NUM_TIERS = len(Tier)
_TIERS = tuple(Tier)


@dataclass(slots=True)
class _Stream:
    key_to_counts: dict[int, list[int]] = field(default_factory=dict)
    hash_to_key: dict[int, int] = field(default_factory=dict)
    blocks_by_tier: list[int] = field(default_factory=lambda: [0] * _NUM_TIERS)
    watermark: int = -1
    last_ts: float | None = None

    def reset(self) -> None:
        self.key_to_counts.clear()
        self.hash_to_key.clear()
        self.blocks_by_tier = [0] * _NUM_TIERS


@dataclass(slots=True)
class _Tally:
    num_unknown_removals: int = 0
    num_unresolved_stores: int = 0


class MemoryIndex:
    """In-process block index. Thread-safe; every call holds one lock briefly."""

    def __init__(self) -> None:
        self._streams: dict[StreamId, _Stream] = {}
        self._lock = threading.Lock()

    def apply(self, stream: StreamId, seq: int, ts: float, ops: Sequence[Op]) -> ApplyResult:
        with self._lock:
            state = self._streams.get(stream)
            if state is None:
                state = self._streams[stream] = _Stream()
            if seq <= state.watermark:
                return SKIPPED
            tally = _Tally()
            for op in ops:
                _apply_op(state, tally, op)
            state.watermark = seq
            state.last_ts = ts
            return ApplyResult(True, tally.num_unknown_removals, tally.num_unresolved_stores)

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

    def close(self) -> None:
        pass


def _apply_op(state: _Stream, tally: _Tally, op: Op) -> None:
    kind, tier, engine_hash, key = op
    if kind == OpKind.STORE:
        state.hash_to_key[engine_hash] = key
        _bump(state, key, tier, 1)
    elif kind == OpKind.STORE_BY_HASH:
        found = state.hash_to_key.get(engine_hash)
        if found is None:
            tally.num_unresolved_stores += 1
        else:
            _bump(state, found, tier, 1)
    elif kind == OpKind.REMOVE:
        found = state.hash_to_key.get(engine_hash)
        if found is None or not _bump(state, found, tier, -1):
            tally.num_unknown_removals += 1
        elif found not in state.key_to_counts:
            del state.hash_to_key[engine_hash]
    elif kind == OpKind.CLEAR:
        state.reset()


def _bump(state: _Stream, key: int, tier: int, delta: int) -> bool:
    """Add ``delta`` to a block's count on a tier; False if that would go below zero."""
    counts = state.key_to_counts.get(key)
    if counts is None:
        if delta < 0:
            return False
        counts = state.key_to_counts[key] = [0] * _NUM_TIERS
    before = counts[tier]
    after = before + delta
    if after < 0:
        return False
    counts[tier] = after
    if before == 0:
        state.blocks_by_tier[tier] += 1
    elif after == 0:
        state.blocks_by_tier[tier] -= 1
        if not any(counts):
            del state.key_to_counts[key]
    return True


def _prefix(state: _Stream, keys: Sequence[int]) -> PrefixMatch:
    tiers: list[Tier] = []
    get = state.key_to_counts.get
    for key in keys:
        counts = get(key)
        if counts is None:
            break
        tiers.append(_best_tier(counts))
    return PrefixMatch(tuple(tiers))


def _best_tier(counts: list[int]) -> Tier:
    for tier in _TIERS:
        if counts[tier]:
            return tier
    raise AssertionError("a held block has a non-zero count on some tier")
