"""Shared prefixes and prefix_hash groups, counted over block keys."""

from __future__ import annotations

import random
from collections import Counter

from kvindex.clients.analyze.prefixes import PrefixCounts, PrefixTree
from kvindex.indexer.domain.keys import block_keys


def counts_of(*rows: list[int]) -> PrefixCounts:
    tree = PrefixTree()
    for row in rows:
        tree.add(row)
    return tree.counts()


def test_the_tree_is_the_cache_a_request_hits_a_prefix_of_its_keys() -> None:
    tree = PrefixTree()
    assert tree.add([1, 2, 3]) == 0
    assert tree.add([1, 2, 4]) == 2
    assert tree.add([]) == 0
    assert tree.add([1, 2, 3, 7]) == 3
    assert (tree.num_requests, tree.num_keyless) == (4, 1)


def test_maximal_prefixes_most_requests_first() -> None:
    counts = counts_of([1, 2, 3], [1, 2, 4], [1, 5], [9], [])
    found = counts.shared_prefixes()
    assert [(p.key, p.blocks, p.requests) for p in found] == [(1, 1, 3), (2, 2, 2)]
    assert [p.example for p in found] == [0, 0]


def test_a_prefix_all_its_requests_continue_past_is_not_maximal() -> None:
    counts = counts_of([1, 2, 3], [1, 2, 3], [1, 2])
    found = counts.shared_prefixes()
    assert [(p.key, p.blocks, p.requests) for p in found] == [(2, 2, 3), (3, 3, 2)]


def test_largest_group_by_blocks() -> None:
    counts = counts_of([1, 2, 3], [1, 2, 4], [1, 5], [9], [])
    assert counts.largest_group_by_blocks() == [3 / 5, 2 / 5, 1 / 5]
    assert counts_of([], []).largest_group_by_blocks() == []


def reference(rows: list[list[int]]) -> tuple[list[tuple[int, int, int, int]], list[float]]:
    """Counted over every occurrence, as the definition reads: (key, blocks, requests, the
    first request where it is maximal) of each maximal prefix, and the largest group by
    blocks."""
    sharing = Counter(key for row in rows for key in row)
    first: dict[int, int] = {}
    maximal: set[int] = set()
    for index, row in enumerate(rows):
        for position, key in enumerate(row):
            following = sharing[row[position + 1]] if position + 1 < len(row) else 0
            if sharing[key] >= 2 and sharing[key] > following:
                maximal.add(key)
                first.setdefault(key, index)
    position_of = {key: pos for row in rows for pos, key in enumerate(row)}
    found = sorted(
        ((k, position_of[k] + 1, sharing[k], first[k]) for k in maximal),
        key=lambda p: (-p[2], -p[1], p[0]),
    )
    largest = [0] * (max((len(r) for r in rows), default=0))
    for key, count in sharing.items():
        largest[position_of[key]] = max(largest[position_of[key]], count)
    keyless = sum(1 for r in rows if not r)
    return found, [max(n, keyless) / len(rows) for n in largest]


def test_the_tree_counts_as_every_occurrence_would() -> None:
    rng = random.Random(3)
    heads = [[rng.randrange(4) for _ in range(rng.randrange(0, 9))] for _ in range(6)]
    rows = []
    for _ in range(300):  # shared heads, then tails of their own or from a few
        tokens = rng.choice(heads) + [rng.randrange(3) for _ in range(rng.randrange(0, 6))]
        rows.append(block_keys("m", tokens, 2))
    counts = counts_of(*rows)
    found = [(p.key, p.blocks, p.requests, p.example) for p in counts.shared_prefixes()]
    expected_found, expected_largest = reference(rows)
    assert found == expected_found
    assert counts.largest_group_by_blocks() == expected_largest
