"""The shared prefixes: the longest prefixes that several requests have in common.

A prefix of ``n`` blocks is one block key (keys are chained: the key of block ``n - 1``
names the whole prefix). A prefix is *maximal* where the requests having it stop sharing:
the next block of each of them is shared by fewer requests (or there is none). Counted
over every request's keys at once with numpy (one sort of all keys); the same counts say
how the requests would group under ``prefix_hash`` for each ``prefix_blocks``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    key: int
    blocks: int
    requests: int
    example: int
    """Index of a request that has it."""


class PrefixCounts:
    """How many requests share each prefix, counted once over every request's keys."""

    def __init__(self, keys: Sequence[npt.NDArray[np.uint64]]) -> None:
        lengths = np.array([len(k) for k in keys], dtype=np.int64)
        self.num_requests = len(keys)
        self.num_keyless = int((lengths == 0).sum())
        """Requests without a full block (``prefix_hash`` hashes them all alike)."""
        every = np.concatenate(keys) if len(keys) else np.zeros(0, dtype=np.uint64)
        starts = np.cumsum(lengths) - lengths
        self._every = every
        self._owner = np.repeat(np.arange(len(keys)), lengths)
        self._position = np.arange(len(every)) - np.repeat(starts, lengths)
        _, self._inverse, counts = np.unique(every, return_inverse=True, return_counts=True)
        self._sharing = counts[self._inverse]
        following = np.zeros_like(self._sharing)
        following[:-1] = self._sharing[1:]
        ends = (starts + lengths - 1)[lengths > 0]
        following[ends] = 0
        self._following = following

    def shared_prefixes(self) -> list[SharedPrefix]:
        """Every maximal prefix at least 2 requests share, most requests first, then longest."""
        sharing = self._sharing
        maximal = np.nonzero((sharing >= 2) & (sharing > self._following))[0]
        _, first = np.unique(self._inverse[maximal], return_index=True)
        found = [
            SharedPrefix(
                int(self._every[i]),
                int(self._position[i]) + 1,
                int(sharing[i]),
                int(self._owner[i]),
            )
            for i in maximal[first]
        ]
        found.sort(key=lambda p: (-p.requests, -p.blocks))
        return found

    def largest_group_by_blocks(self) -> list[float]:
        """Entry ``n - 1``: the largest share of the requests that have the same first ``n``
        blocks (those with none count as one group; shorter ones as their own)."""
        if not len(self._every):
            return []
        largest = np.zeros(int(self._position.max()) + 1, dtype=np.int64)
        np.maximum.at(largest, self._position, self._sharing)
        largest = np.maximum(largest, self.num_keyless)
        return [float(share) for share in largest / self.num_requests]
