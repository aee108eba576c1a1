"""The longest prefixes several requests share: chained block keys as a tree, where the
requests having a prefix are the request ends under its key."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np
import numpy.typing as npt

Ints = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    key: int
    blocks: int
    requests: int
    example: int
    """The first request that has it."""


class PrefixTree:
    """Every distinct block key, fed in log order by :meth:`add`; the walk's cache."""

    def __init__(self) -> None:
        self.num_requests = 0
        self.num_keyless = 0
        self._seen: set[int] = set()
        self._keys = array("Q")
        self._parents = array("Q")  # 0 at position 0
        self._positions = array("I")
        self._owners = array("I")  # the request that first had the key
        self._last_keys = array("Q")

    def add(self, keys: Sequence[int]) -> int:
        """Record the next request's chained block keys; how many leading ones were known."""
        index = self.num_requests
        self.num_requests += 1
        if not keys:
            self.num_keyless += 1
            return 0
        seen = self._seen
        hits = 0
        for key in keys:
            if key not in seen:
                break
            hits += 1
        new = keys[hits:]
        if new:
            seen.update(new)
            self._keys.extend(new)
            self._parents.append(keys[hits - 1] if hits else 0)
            self._parents.extend(new[:-1])
            self._positions.extend(range(hits, len(keys)))
            self._owners.extend(repeat(index, len(new)))
        self._last_keys.append(keys[-1])
        return hits

    def counts(self) -> PrefixCounts:
        keys = np.frombuffer(self._keys, dtype=np.uint64)
        positions = np.frombuffer(self._positions, dtype=np.uint32).astype(np.int64)
        order = np.argsort(keys)
        sorted_keys = keys[order]

        def slots(of: npt.NDArray[np.uint64]) -> Ints:
            found: Ints = order[np.searchsorted(sorted_keys, of)]
            return found

        ends = np.bincount(
            slots(np.frombuffer(self._last_keys, dtype=np.uint64)), minlength=len(keys)
        )
        parents = np.full(len(keys), -1, dtype=np.int64)
        inner = positions > 0
        parents[inner] = slots(np.frombuffer(self._parents, dtype=np.uint64)[inner])
        return PrefixCounts(
            keys=keys,
            positions=positions,
            owners=np.frombuffer(self._owners, dtype=np.uint32),
            requests=_subtree_sums(ends.astype(np.int64), parents, positions),
            parents=parents,
            num_requests=self.num_requests,
            num_keyless=self.num_keyless,
        )


def _subtree_sums(ends: Ints, parents: Ints, positions: Ints) -> Ints:
    """Per key, the ends at it or under it: deepest level first, each added to its parent."""
    totals = ends.copy()
    by_level = np.argsort(positions, kind="stable")
    deepest = int(positions.max()) if len(positions) else 0
    bounds = np.searchsorted(positions[by_level], np.arange(deepest + 2))
    for level in range(deepest, 0, -1):
        nodes = by_level[bounds[level] : bounds[level + 1]]
        np.add.at(totals, parents[nodes], totals[nodes])
    return totals


class PrefixCounts:
    """Per key of a :class:`PrefixTree`: position, first request, parent, requests having it."""

    def __init__(
        self,
        *,
        keys: npt.NDArray[np.uint64],
        positions: Ints,
        owners: npt.NDArray[np.uint32],
        requests: Ints,
        parents: Ints,
        num_requests: int,
        num_keyless: int,
    ) -> None:
        self.num_requests = num_requests
        self.num_keyless = num_keyless
        self._keys, self._positions, self._owners = keys, positions, owners
        self._requests = requests
        inner = parents >= 0
        self._most_shared_child = np.zeros_like(requests)
        np.maximum.at(self._most_shared_child, parents[inner], requests[inner])

    def shared_prefixes(self) -> list[SharedPrefix]:
        """Maximal prefixes shared by 2 or more: most requests, then longest, then key first."""
        requests = self._requests
        maximal = np.nonzero((requests >= 2) & (requests > self._most_shared_child))[0]
        found = [
            SharedPrefix(
                int(self._keys[i]),
                int(self._positions[i]) + 1,
                int(requests[i]),
                int(self._owners[i]),
            )
            for i in maximal
        ]
        found.sort(key=lambda p: (-p.requests, -p.blocks, p.key))
        return found

    def largest_group_by_blocks(self) -> list[float]:
        """Entry ``n - 1``: the largest share of requests with the same first ``n`` blocks."""
        if not len(self._keys):
            return []
        largest = np.zeros(int(self._positions.max()) + 1, dtype=np.int64)
        np.maximum.at(largest, self._positions, self._requests)
        largest = np.maximum(largest, self.num_keyless)
        return [float(share) for share in largest / self.num_requests]
