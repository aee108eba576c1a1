"""The fragmentation finder: a short span that differs, before content many requests share.

Past a request's break, an *anchor* (a content-chosen window) an earlier request had marks
where shared content resumes. The fix moves the span after it; fixed blocks found among
earlier fixed prompts are *recoverable*."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from kvindex.indexer.domain.keys import chain_keys, model_root, tokens_to_bytes

WINDOW_TOKENS = 16
"""Tokens per hashed window (shared content must run at least this long to be seen)."""
ANCHOR_EVERY = 8
"""A window is an anchor when its hash is a multiple of this (one window in 8 on average)."""
MAX_SPAN_TOKENS = 96
"""The longest differing span looked for (a timestamp, an id, a name: a few dozen tokens)."""
SCAN_TOKENS = MAX_SPAN_TOKENS + 4 * WINDOW_TOKENS
MIN_REQUESTS = 3
"""A finding needs this many requests resuming at the same shared content."""
MIN_RECOVERABLE_FRACTION = 0.01
"""...and must make this share of all prompt tokens cacheable."""
EXAMPLES_KEPT = 8

_hash = xxhash.xxh3_64_intdigest
_TOKEN_BYTES = 4


@dataclass(slots=True)
class FragmentGroup:
    base: int
    """Where the spans start (the first member's break); the fix keeps ``tokens[:base]``."""
    members: int = 0
    recoverable_tokens: int = 0
    examples: list[tuple[int, list[int]]] = field(default_factory=list)
    """(request index, ``tokens[base:resume]``) of the first few members."""


def anchors(tokens: Sequence[int], start: int) -> list[tuple[int, int]]:
    """(offset from ``start``, hash) of the anchors in ``tokens[start:][:SCAN_TOKENS]``."""
    data = tokens_to_bytes(tokens[start : start + SCAN_TOKENS])
    width = WINDOW_TOKENS * _TOKEN_BYTES
    found: list[tuple[int, int]] = []
    for offset in range(0, len(data) - width + 1, _TOKEN_BYTES):
        h = _hash(data[offset : offset + width])
        if h % ANCHOR_EVERY == 0:
            found.append((offset // _TOKEN_BYTES, h))
    return found


class FragmentationFinder:
    """Sees each request once, in order (:meth:`observe`); :attr:`groups` by anchor hash."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.groups: dict[int, FragmentGroup] = {}
        self._anchors: set[int] = set()  # every earlier request's anchors
        self._seen_fixed: set[int] = set()

    def observe(
        self, index: int, model: str, tokens: Sequence[int], keys: Sequence[int], hit_blocks: int
    ) -> int:
        """Record request ``index``; the tokens its fix would make cacheable (0: none)."""
        if hit_blocks >= len(keys):
            return 0  # every full block is cached already
        start = hit_blocks * self.block_size
        found = anchors(tokens, start)
        recoverable = 0
        resume = self._resume(found)
        if resume is not None:
            offset, h = resume
            recoverable = self._fix(h, index, model, tokens, keys, hit_blocks, start + offset)
        self._anchors.update(h for _, h in found)
        return recoverable

    def _resume(self, found: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
        """(offset, hash) of the known anchor, followed by a known one, whose group is largest."""
        known, groups = self._anchors, self.groups
        best: tuple[int, int] | None = None
        best_members = -1
        for i, (offset, h) in enumerate(found):
            if not 0 < offset <= MAX_SPAN_TOKENS or h not in known:
                continue
            if i + 1 < len(found) and found[i + 1][1] not in known:
                continue
            group = groups.get(h)
            members = group.members if group is not None else 0
            if members > best_members:
                best, best_members = (offset, h), members
        return best

    def _fix(  # noqa: PLR0917 (one call site, the request's facts in order)
        self,
        anchor: int,
        index: int,
        model: str,
        tokens: Sequence[int],
        keys: Sequence[int],
        hit_blocks: int,
        resume: int,
    ) -> int:
        """Tokens gained by keying ``tokens[:base] + tokens[resume:]`` among earlier fixes."""
        size = self.block_size
        group = self.groups.get(anchor)
        if group is None:
            group = self.groups[anchor] = FragmentGroup(hit_blocks * size)
        base_blocks = min(group.base // size, hit_blocks)
        parent = keys[base_blocks - 1] if base_blocks else model_root(model)
        fixed = chain_keys(parent, tokens_to_bytes(tokens[resume:]), size)
        seen = self._seen_fixed
        hits = 0
        for key in fixed:
            if key not in seen:
                break
            hits += 1
        seen.update(fixed[hits:])
        gained = max(0, base_blocks + hits - hit_blocks) * size
        group.members += 1
        group.recoverable_tokens += gained
        if len(group.examples) < EXAMPLES_KEPT:
            group.examples.append((index, list(tokens[base_blocks * size : resume])))
        return gained


def common_prefix(spans: Sequence[Sequence[int]]) -> int:
    shortest = min((len(s) for s in spans), default=0)
    head = 0
    while head < shortest and all(s[head] == spans[0][head] for s in spans):
        head += 1
    return head


def varying_texts(texts: Sequence[str]) -> list[str]:
    """Each text without what all of them start and end with, cut at whitespace."""
    if len(texts) < 2:
        return [t.strip() for t in texts]
    head = len(_common_start(texts))
    while head > 0 and not texts[0][head - 1].isspace():
        head -= 1
    tails = [t[head:][::-1] for t in texts]
    tail = len(_common_start(tails))
    while tail > 0 and not tails[0][tail - 1].isspace():
        tail -= 1
    return [t[head : len(t) - tail].strip() for t in texts]


def _common_start(texts: Sequence[str]) -> str:
    first = texts[0]
    n = min(len(t) for t in texts)
    i = 0
    while i < n and all(t[i] == first[i] for t in texts):
        i += 1
    return first[:i]
