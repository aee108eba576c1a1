"""The fragmentation finder on token ids: spans of any length, anchors by content."""

from __future__ import annotations

import random

from kvindex.clients.analyze.cache_walk import CacheWalk
from kvindex.clients.analyze.fragmentation import (
    MAX_SPAN_TOKENS,
    anchors,
    common_prefix,
    varying_texts,
)


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 30_000) for _ in range(n)]


def walk_of(prompts: list[list[int]]) -> CacheWalk:
    walk = CacheWalk(16)
    for p in prompts:
        walk.add("m", p)
    return walk


def test_anchors_depend_on_content_not_on_position() -> None:
    body = ids(random.Random(1), 200)
    here = anchors([7] * 5 + body, 5)
    there = anchors([8] * 37 + body, 37)
    assert here and here == there


def test_a_span_of_any_length_before_shared_content_is_found() -> None:
    rng = random.Random(2)
    head, body = ids(rng, 40), ids(rng, 600)
    prompts = [head + ids(rng, rng.randint(1, 30)) + body + ids(rng, 10) for _ in range(50)]
    walk = walk_of(prompts)
    (group,) = walk.finder.groups.values()
    assert group.members == 49
    assert group.base == 32  # the head's full blocks stay in front
    # Every member but the first recovers the body's blocks, less the few tokens before
    # the first anchor and one partial block.
    assert group.recoverable_tokens >= 48 * (600 - 64)
    assert walk.recoverable_tokens == group.recoverable_tokens


def test_unshared_tails_and_long_spans_are_no_finding() -> None:
    rng = random.Random(3)
    system = ids(rng, 300)
    walk = walk_of([system + ids(rng, 50) for _ in range(40)])
    assert walk.finder.groups == {}
    body = ids(rng, 400)
    walk = walk_of([ids(rng, MAX_SPAN_TOKENS + 40) + body for _ in range(20)])
    assert walk.finder.groups == {}


def test_identical_prompts_need_no_fix() -> None:
    prompt = ids(random.Random(4), 300)
    walk = walk_of([prompt] * 10)
    assert walk.recoverable_tokens == 0
    assert walk.cached_tokens == 9 * (300 // 16) * 16


def test_varying_texts_cut_at_whitespace() -> None:
    texts = ["now: 2026-12-02T00:01:27Z\nrules", "now: 2026-12-02T00:02:43Z\nrules"]
    assert varying_texts(texts) == ["2026-12-02T00:01:27Z", "2026-12-02T00:02:43Z"]
    assert varying_texts(["only one "]) == ["only one"]


def test_common_prefix() -> None:
    assert common_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_prefix([]) == 0
