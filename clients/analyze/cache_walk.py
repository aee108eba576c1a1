"""The cache walk: every request, in log order, through one unbounded cache of blocks (keyed
as the index keys them): the single-cache ceiling, what any router could at best reuse."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvindex.clients.analyze.fragmentation import FragmentationFinder
from kvindex.clients.analyze.prefixes import PrefixTree
from kvindex.indexer.domain.keys import block_keys

START_TOKENS = 48
"""Tokens kept from the start of every request (a shared prefix is shown by them)."""

Counts = npt.NDArray[np.int64]


@dataclass(slots=True)
class PositionProfile:
    """Per block position: prompt tokens, cached tokens, cached tokens after the fix."""

    tokens: Counts
    cached: Counts
    cached_after_fix: Counts

    @classmethod
    def empty(cls) -> PositionProfile:
        return cls(*(np.zeros(0, dtype=np.int64) for _ in range(3)))

    def grow(self, num_positions: int) -> None:
        if num_positions > len(self.tokens):
            size = max(num_positions, 2 * len(self.tokens))
            for name in ("tokens", "cached", "cached_after_fix"):
                old = getattr(self, name)
                new = np.zeros(size, dtype=np.int64)
                new[: len(old)] = old
                setattr(self, name, new)


class CacheWalk:
    """Feed requests with :meth:`add`, in order; read the totals and the kept state."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.finder = FragmentationFinder(block_size)
        self.profile = PositionProfile.empty()
        self.num_requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.recoverable_tokens = 0
        self.prefixes = PrefixTree()
        self.starts: list[array[int]] = []
        self.models: list[str] = []
        self.hit_blocks: list[int] = []

    def add(self, model: str, tokens: Sequence[int]) -> None:
        size = self.block_size
        keys = block_keys(model, tokens, size)
        hits = self.prefixes.add(keys)
        recoverable = self.finder.observe(self.num_requests, model, tokens, keys, hits)
        self._count(len(tokens), len(keys), hits, recoverable // size)
        self.starts.append(array("I", tokens[:START_TOKENS]))
        self.models.append(model)
        self.hit_blocks.append(hits)

    def _count(self, num_tokens: int, num_blocks: int, hits: int, fixed_blocks: int) -> None:
        size, profile = self.block_size, self.profile
        self.num_requests += 1
        self.prompt_tokens += num_tokens
        self.cached_tokens += hits * size
        self.recoverable_tokens += fixed_blocks * size
        profile.grow(num_blocks + 1)
        profile.tokens[:num_blocks] += size
        profile.tokens[num_blocks] += num_tokens - num_blocks * size
        profile.cached[:hits] += size
        profile.cached_after_fix[: hits + fixed_blocks] += size
