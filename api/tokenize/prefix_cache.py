"""Token ids of texts, found again by a later text starting the same up to a cut (:mod:`.cuts`):
u32 bytes under 128-bit SHA-256 digests of their starts, an LRU bounded by bytes."""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

ENTRY_OVERHEAD_BYTES = 256
"""What an entry costs besides its ids and cuts: its record, the LRU's node."""
CUT_OVERHEAD_BYTES = 160
"""What one cut costs: its digest, its slot in the digest map and in the entry."""
_DIGEST_BYTES = 16


# The digests' seeds: a word anchor's names the text up to its window's end, not its cut.
CUTS = b"kvindex prefix\0"
WORD_ANCHORS = b"kvindex word anchors\0"


def cut_digests(text: str, positions: Sequence[int], seed: bytes = CUTS) -> list[bytes]:
    """The digest of ``text[:p]`` for each of ``positions`` (ascending), in one pass."""
    running = hashlib.sha256(seed)
    digests, start = [], 0
    for position in positions:
        running.update(text[start:position].encode("utf-8", "surrogatepass"))
        digests.append(running.digest()[:_DIGEST_BYTES])  # digest() leaves the state as it was
        start = position
    return digests


@dataclass(frozen=True, slots=True)
class KeptCut:
    """A cut of a kept text: the digest of the text before it, and the ids before it."""

    digest: bytes
    num_tokens: int
    resume: int | None = None  # a word anchor's cut (its digest: up to its window's end)


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The longest kept prefix of a text: its cut's index, its ids (packed), its cuts."""

    index: int
    packed: bytes
    cuts: tuple[KeptCut, ...]
    """The kept cuts up to and including this one."""


@dataclass(frozen=True, slots=True)
class _Entry:
    packed: bytes
    cuts: tuple[KeptCut, ...]


def entry_bytes(packed: bytes, num_cuts: int) -> int:
    """What one text counts against ``max_bytes``."""
    return len(packed) + ENTRY_OVERHEAD_BYTES + num_cuts * CUT_OVERHEAD_BYTES


class PrefixCache:
    """Texts' ids by their cuts' digests, at most ``max_bytes`` (:func:`entry_bytes`); a text
    larger than that alone is not kept. Not thread-safe: one event loop uses it."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._digest_to_cut: dict[bytes, tuple[int, int]] = {}
        """Per digest: the entry that holds it (the latest kept), the cut's index there."""
        self._numbers = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, digests: Sequence[bytes]) -> PrefixHit | None:
        """The longest of a text's cuts (their digests, in order) that a kept text shares."""
        for index in range(len(digests) - 1, -1, -1):
            found = self._digest_to_cut.get(digests[index])
            if found is not None:
                number, at = found
                entry = self._entries[number]
                self._entries.move_to_end(number)
                cuts = entry.cuts[: at + 1]
                return PrefixHit(index, entry.packed[: 4 * cuts[-1].num_tokens], cuts)
        return None

    def keep(self, packed: bytes, cuts: tuple[KeptCut, ...]) -> None:
        """Keep a text's ids (packed) under its cuts; its cuts' digests now name it."""
        size = entry_bytes(packed, len(cuts))
        if not cuts or size > self.max_bytes:
            return
        number = next(self._numbers)
        self._entries[number] = _Entry(packed, cuts)
        self.num_bytes += size
        for at, cut in enumerate(cuts):
            self._digest_to_cut[cut.digest] = (number, at)
        while self.num_bytes > self.max_bytes:
            self._evict()

    def _evict(self) -> None:
        number, entry = self._entries.popitem(last=False)
        self.num_bytes -= entry_bytes(entry.packed, len(entry.cuts))
        for cut in entry.cuts:
            found = self._digest_to_cut.get(cut.digest)
            if found is not None and found[0] == number:
                del self._digest_to_cut[cut.digest]
