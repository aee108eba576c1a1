"""The prefix-cache block pool of every stand-in for vLLM (vLLM's v1 ``BlockPool`` for one
KV-cache group, empty blocks handed out before any eviction), and the KV events it publishes."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

from kvindex.clients.fake_vllm.engine_hash import engine_chain
from kvindex.indexer.domain.events import BlockRemoved, BlockStored, Event, ExtraKeys, Tier
from kvindex.indexer.domain.keys import request_extra_keys

GROUP_IDX = 0
"""The KV-cache group of a plain (non-hybrid) model, as vLLM numbers it in events."""


@dataclass(slots=True)
class _Held:
    """Blocks one request holds: its cached chain and its slots not full yet."""

    hashes: list[int]
    num_slots: int
    lora_name: str | None
    cache_salt: str | None


@dataclass(frozen=True, slots=True)
class Admission:
    num_hit_blocks: int
    events: list[Event]


class BlockPool:
    """``capacity_blocks`` blocks of ``block_size`` tokens; not thread-safe; changes return their
    events in order. Drive it by :meth:`admit`, or :meth:`touch` and :meth:`allocate`."""

    def __init__(
        self, capacity_blocks: int, block_size: int, root: int, *, publish: bool = True
    ) -> None:
        """``publish=False``: make no events (a pool nobody listens to)."""
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.root = root
        self.publish = publish
        self.num_empty = capacity_blocks
        self.num_evicted = 0
        """Cached blocks evicted so far (one ``BlockRemoved`` each when publishing)."""
        self._ref: dict[int, int] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._held: dict[int, _Held] = {}

    # --- reading ---------------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        """Distinct hashes cached: what an index must hold for this pool."""
        return len(self._ref)

    @property
    def num_free(self) -> int:
        """Blocks a request could take now: empty or evictable."""
        return self.num_empty + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks pinned by requests (vLLM's 'used': not free, not evictable)."""
        return self.capacity_blocks - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.capacity_blocks

    def is_cached(self, block: int) -> bool:
        return block in self._ref

    def evictable(self) -> list[int]:
        """Evictable hashes, next to be evicted first."""
        return list(self._evictable)

    def num_held_slots(self) -> int:
        return sum(h.num_slots for h in self._held.values())

    def chain(
        self, tokens: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None
    ) -> list[int]:
        """Engine hashes of every full block of ``tokens`` (a request's own blocks)."""
        extras = request_extra_keys(len(tokens) // self.block_size, lora_name, cache_salt)
        return engine_chain(self.root, tokens, self.block_size, extras)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check(self) -> None:
        """Assert the pool's invariants (tests)."""
        assert self.num_empty >= 0
        assert self.num_empty + self.num_held_slots() + len(self._ref) == self.capacity_blocks
        assert all((n == 0) == (h in self._evictable) for h, n in self._ref.items())

    # --- a whole request at once -----------------------------------------------------------

    def admit(
        self,
        request_id: int,
        prompt: Sequence[int],
        total_tokens: int,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        chain: Sequence[int] | None = None,
    ) -> Admission | None:
        """Reserve blocks for ``total_tokens`` and cache the full prompt blocks; None: no room."""
        if chain is None:
            chain = self.chain(prompt, lora_name, cache_salt)
        limit = min((len(prompt) - 1) // self.block_size, len(chain))
        hits = self._num_hits(chain, limit)
        need = self.num_blocks_for(total_tokens) - hits
        evictable = self._evictable
        hit_evictable = sum(1 for h in chain[:hits] if h in evictable) if evictable else 0
        if need > self.num_free - hit_evictable:
            return None
        self._pin(request_id, chain[:hits], lora_name, cache_salt)
        events = self.allocate(request_id, need)
        events.extend(self.cache_full_blocks(request_id, prompt, chain))
        return Admission(hits, events)

    def _num_hits(self, chain: Sequence[int], limit: int) -> int:
        ref = self._ref
        hits = 0
        while hits < limit and chain[hits] in ref:
            hits += 1
        return hits

    # --- step by step ----------------------------------------------------------------------

    def touch(self, request_id: int, chain: Sequence[int], limit: int) -> int:
        """Pin the longest cached prefix of ``chain`` (up to ``limit``) for a request; its size."""
        hits = self._num_hits(chain, limit)
        self._pin(request_id, chain[:hits], None, None)
        return hits

    def allocate(self, request_id: int, count: int) -> list[Event]:
        """``count`` more slots (``count <= num_free``), evicting least recently freed first."""
        take = min(count, self.num_empty)
        self.num_empty -= take
        self._held[request_id].num_slots += count
        ref, evictable = self._ref, self._evictable
        events: list[Event] = []
        for _ in range(count - take):
            victim, _ = evictable.popitem(last=False)
            del ref[victim]
            if self.publish:
                events.append(BlockRemoved((victim,), Tier.GPU, GROUP_IDX))
        self.num_evicted += count - take
        return events

    def cache_full_blocks(
        self, request_id: int, tokens: Sequence[int], chain: Sequence[int] | None = None
    ) -> list[Event]:
        """Cache the full blocks of ``tokens`` not cached yet (one ``BlockStored`` per run)."""
        held = self._held[request_id]
        if chain is None:
            chain = self.chain(tokens, held.lora_name, held.cache_salt)
        runs = self._cache_new(held, chain)
        if not self.publish or not runs:
            return []
        extras = request_extra_keys(len(chain), held.lora_name, held.cache_salt)
        lora = held.lora_name
        return [
            self._stored(first, end, chain, tokens, extras=extras, lora_name=lora)
            for first, end in runs
        ]

    def release(self, request_id: int) -> None:
        """Unpin a request's blocks (tail first onto the LRU) and free its slots."""
        held = self._held.pop(request_id)
        ref, evictable = self._ref, self._evictable
        for h in reversed(held.hashes):
            count = ref[h] - 1
            ref[h] = count
            if not count:
                evictable[h] = None
        self.num_empty += held.num_slots

    # --- inside ----------------------------------------------------------------------------

    def _pin(
        self, request_id: int, hits: Sequence[int], lora_name: str | None, cache_salt: str | None
    ) -> None:
        assert request_id not in self._held, f"request {request_id} already holds blocks"
        ref, evictable = self._ref, self._evictable
        for h in hits:
            ref[h] += 1
            evictable.pop(h, None)
        self._held[request_id] = _Held(list(hits), 0, lora_name, cache_salt)

    def _cache_new(self, held: _Held, chain: Sequence[int]) -> list[tuple[int, int]]:
        """The (first, end) runs of ``chain``'s blocks newly cached past those ``held`` has."""
        start = len(held.hashes)
        new = chain[start:]
        if not new:
            return []
        ref = self._ref
        held.num_slots -= len(new)
        held.hashes.extend(new)
        if ref.keys().isdisjoint(new):  # the usual case: no block computed concurrently
            ref.update(dict.fromkeys(new, 1))
            return [(start, len(chain))]
        runs: list[tuple[int, int]] = []
        run_start = start
        for i in range(start, len(chain)):
            h = chain[i]
            if h in ref:
                ref[h] += 1
                self._evictable.pop(h, None)
                self.num_empty += 1
                if run_start < i:
                    runs.append((run_start, i))
                run_start = i + 1
            else:
                ref[h] = 1
        if run_start < len(chain):
            runs.append((run_start, len(chain)))
        return runs

    def _stored(
        self,
        first: int,
        end: int,
        chain: Sequence[int],
        tokens: Sequence[int],
        *,
        extras: list[ExtraKeys] | None,
        lora_name: str | None,
    ) -> Event:
        size = self.block_size
        return BlockStored(
            block_hashes=tuple(chain[first:end]),
            parent_hash=chain[first - 1] if first > 0 else None,
            token_ids=tuple(tokens[first * size : end * size]),
            block_size=size,
            tier=Tier.GPU,
            lora_name=lora_name,
            extra_keys=(None,) * (end - first) if extras is None else tuple(extras[first:end]),
            group_idx=GROUP_IDX,
        )
