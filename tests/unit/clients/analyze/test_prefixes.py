"""Shared prefixes and prefix_hash groups, counted over block keys."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvindex.clients.analyze.prefixes import PrefixCounts


def chains(*rows: list[int]) -> list[npt.NDArray[np.uint64]]:
    return [np.array(r, dtype=np.uint64) for r in rows]


def test_maximal_prefixes_most_requests_first() -> None:
    counts = PrefixCounts(chains([1, 2, 3], [1, 2, 4], [1, 5], [9], []))
    found = counts.shared_prefixes()
    assert [(p.key, p.blocks, p.requests) for p in found] == [(1, 1, 3), (2, 2, 2)]
    assert found[1].example in (0, 1)


def test_largest_group_by_blocks() -> None:
    counts = PrefixCounts(chains([1, 2, 3], [1, 2, 4], [1, 5], [9], []))
    assert counts.largest_group_by_blocks() == [3 / 5, 2 / 5, 1 / 5]
    assert PrefixCounts(chains([], [])).largest_group_by_blocks() == []
