"""The memory index's tables in plain dicts: the oracle the compiled ``native.Tables`` is held to.

``holders`` maps a block key to ``~number`` of its one holder (nothing allocated for the
common private block) or the bitmap of its holders' numbers; a block's counts are one int,
``gpu + cpu * 2**32 + other * 2**64``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvindex.indexer.domain.events import Tier
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import Op, OpKind

_NUM_TIERS = len(Tier)
_LANE_BITS = 32
_LANE = (1 << _LANE_BITS) - 1
_UNIT = tuple(1 << (_LANE_BITS * t) for t in range(_NUM_TIERS))
"""What one more block on a tier adds to a block's packed counts."""
_SHIFT = tuple(_LANE_BITS * t for t in range(_NUM_TIERS))
_STORE, _STORE_BY_HASH, _REMOVE = int(OpKind.STORE), int(OpKind.STORE_BY_HASH), int(OpKind.REMOVE)


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
    """``kvindex.indexer.index.memory.Tables`` in plain dicts."""

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
        for number in numbers(bitmap):
            _, on_cpu, on_other = self._of(number).blocks_by_tier
            if on_cpu or on_other:
                mixed.append(number)
            else:
                indices.append(index_of[number])
        return indices, mixed


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


def numbers(bitmap: int) -> Iterator[int]:
    """The set bits of a bitmap, ascending (string scans: a bit operation on a wide int
    would allocate a new one per bit)."""
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


def python_index() -> MemoryIndex:
    """A :class:`MemoryIndex` on these tables."""
    return MemoryIndex(tables=PyTables())
