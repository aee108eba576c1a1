"""The block pool of every vLLM stand-in: hits, pinning, LRU eviction, the events it returns."""

from __future__ import annotations

import random
import time

from kvindex.clients.fake_vllm.block_pool import BlockPool
from kvindex.clients.fake_vllm.engine_hash import engine_chain
from kvindex.indexer.domain.events import (
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    StreamId,
    Tier,
)
from kvindex.indexer.domain.keys import block_keys
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.ingest.ingestor import Ingestor

ROOT = 7


def pool(capacity: int = 4, block_size: int = 2) -> BlockPool:
    return BlockPool(capacity, block_size, ROOT)


def h(*blocks: tuple[int, ...], extras: tuple[object, ...] | None = None) -> list[int]:
    """Hand-made chain of hashes for blocks of 2 tokens (``extras`` on every block if given)."""
    tokens = [t for block in blocks for t in block]
    return engine_chain(ROOT, tokens, 2, None if extras is None else [extras] * len(blocks))


def stored(hashes: list[int], parent: int | None, tokens: tuple[int, ...]) -> BlockStored:
    """A GPU store as vLLM 0.33 publishes it: no extra keys on any block, group 0."""
    return BlockStored(tuple(hashes), parent, tokens, 2, Tier.GPU, None, (None,) * len(hashes), 0)


def removed(block_hash: int) -> BlockRemoved:
    return BlockRemoved((block_hash,), Tier.GPU, 0)


def test_first_request_stores_its_full_prompt_blocks_then_its_output_blocks() -> None:
    c = pool()
    h12, h34, h56 = h((1, 2), (3, 4), (5, 6))
    admission = c.admit(0, [1, 2, 3, 4, 5], 6)
    assert admission is not None
    assert admission.num_hit_blocks == 0
    assert admission.events == [stored([h12, h34], None, (1, 2, 3, 4))]
    assert c.num_empty == 1  # 3 blocks reserved for 6 tokens
    assert c.cache_full_blocks(0, [1, 2, 3, 4, 5, 6]) == [stored([h56], h34, (5, 6))]
    c.release(0)
    assert c.evictable() == [h56, h34, h12]  # freed tail first: the tail is evicted first
    c.check()


def test_leading_cached_blocks_are_hits_but_one_prompt_token_is_always_computed() -> None:
    c = pool()
    assert c.admit(0, [1, 2, 3, 4, 5], 6) is not None
    c.release(0)
    second = c.admit(1, [1, 2, 3, 4, 9], 5)
    assert second is not None
    assert second.num_hit_blocks == 2
    assert second.events == []  # hits are not announced again
    c.release(1)
    exact = c.admit(2, [1, 2, 3, 4], 4)  # both blocks cached, but only 1 may hit
    assert exact is not None
    assert exact.num_hit_blocks == 1
    assert exact.events == []  # the recomputed last block is the cached one, shared
    c.release(2)
    c.check()


def test_lru_eviction_order_and_removed_events() -> None:
    c = pool()
    h12, h34, h56 = h((1, 2), (3, 4), (5, 6))
    assert c.admit(0, [1, 2, 3, 4, 5], 6) is not None
    c.cache_full_blocks(0, [1, 2, 3, 4, 5, 6])
    c.release(0)
    admission = c.admit(1, [7, 8, 9, 10, 11], 6)  # 3 blocks: 1 empty + 2 evicted
    assert admission is not None
    assert [e for e in admission.events if isinstance(e, BlockRemoved)] == [
        removed(h56),
        removed(h34),
    ]
    assert isinstance(admission.events[-1], BlockStored)
    assert c.is_cached(h12) and not c.is_cached(h34)
    assert c.num_evicted == 2
    c.check()


def test_hit_refreshes_lru_position() -> None:
    c = pool(capacity=6)
    assert c.admit(0, [1, 2, 3], 4) is not None  # caches (1,2)
    c.release(0)
    assert c.admit(1, [5, 6, 7], 4) is not None  # caches (5,6)
    c.release(1)
    assert c.admit(2, [1, 2, 9], 3) is not None  # hit on (1,2): it becomes most recent
    c.release(2)
    assert c.evictable() == [h((5, 6))[0], h((1, 2))[0]]


def test_pinned_blocks_are_never_evicted_and_capacity_is_never_exceeded() -> None:
    c = pool()
    assert c.admit(0, [1, 2, 3], 4) is not None  # holds 2 blocks, (1,2) cached and pinned
    assert c.admit(1, [5, 6], 4) is not None  # the other 2
    assert c.admit(2, [9, 9, 9], 3) is None  # no room: nothing is evictable
    assert (c.num_used_blocks, c.num_free, c.usage) == (4, 0, 1.0)
    c.check()
    c.release(1)
    assert c.admit(2, [9, 9, 9], 3) is not None  # (5,6) evicted, (1,2) still pinned
    assert c.is_cached(h((1, 2))[0])
    c.check()


def test_salt_on_first_block_only_and_lora_on_every_block() -> None:
    c = pool(capacity=9)
    salted = c.admit(0, [1, 2, 3, 4, 5], 5, cache_salt="s")
    assert salted is not None
    [event] = salted.events
    assert isinstance(event, BlockStored)
    assert event.lora_name is None
    assert event.extra_keys == (("s",), None)
    assert event.block_hashes[0] == h((1, 2), extras=("s",))[0] != h((1, 2))[0]
    lora = c.admit(1, [1, 2, 3, 4, 5], 5, lora_name="L", cache_salt="s")
    assert lora is not None
    assert lora.num_hit_blocks == 0  # the adapter is part of the hash
    [event] = lora.events
    assert isinstance(event, BlockStored)
    assert event.lora_name == "L"
    assert event.extra_keys == (("L", "s"), ("L",))
    plain = c.admit(2, [1, 2, 3, 4, 5], 5)
    assert plain is not None
    assert plain.num_hit_blocks == 0


def test_a_block_computed_by_two_running_requests_is_cached_once() -> None:
    # A (prompt 1-4, answer 5-8) runs; B's prompt is A's prompt and answer, so B caches
    # block (5, 6) itself; when A finishes, that block is shared, not stored again, and
    # the run after it is stored with the right parent.
    c = pool(capacity=12)
    a = c.admit(0, [1, 2, 3, 4], 10)
    assert a is not None
    b = c.admit(1, [1, 2, 3, 4, 5, 6, 9], 8)
    assert b is not None and b.num_hit_blocks == 2
    events = c.cache_full_blocks(0, [1, 2, 3, 4, 5, 6, 7, 8, 0, 0])
    c.check()
    chain = h((1, 2), (3, 4), (5, 6), (7, 8), (0, 0))
    assert events == [stored(chain[3:], chain[2], (7, 8, 0, 0))]
    c.release(0)
    c.release(1)
    c.check()
    assert c.num_cached_blocks == 5


def test_a_pool_that_does_not_publish_changes_the_same_but_returns_no_events() -> None:
    quiet, loud = BlockPool(4, 2, ROOT, publish=False), pool()
    for c in (quiet, loud):
        assert c.admit(0, [1, 2, 3, 4, 5], 6) is not None
        c.release(0)
        assert c.admit(1, [7, 8, 9, 10, 11], 6) is not None
    assert quiet.evictable() == loud.evictable() and quiet.num_evicted == loud.num_evicted == 1
    assert quiet.cache_full_blocks(1, [7, 8, 9, 10, 11, 12]) == []


def test_step_by_step_touch_allocate_cache_then_release() -> None:
    """vLLM's scheduler way: hits pinned first, slots taken as tokens are computed."""
    c = pool(capacity=4)
    h12, h34, h56 = h((1, 2), (3, 4), (5, 6))
    assert c.admit(0, [1, 2, 3, 4, 5], 5) is not None
    c.release(0)  # (1,2), (3,4) evictable; 2 empty: one never used, one the 5th token's
    assert (c.num_empty, c.num_free) == (2, 4)
    assert c.touch(1, [h12, h34, h56], 2) == 2
    assert c.num_free == 2 and c.evictable() == []
    assert c.allocate(1, 1) == []  # an empty block first
    assert c.cache_full_blocks(1, [1, 2, 3, 4, 5, 6], [h12, h34, h56]) == [
        stored([h56], h34, (5, 6))
    ]
    assert c.touch(2, [9], 0) == 0
    assert c.allocate(2, 1) == []
    c.release(1)
    assert c.allocate(2, 1) == [removed(h56)]  # tail first: the newest block goes first
    c.check()
    assert c.num_held_slots() == 2 and c.num_cached_blocks == 2


def test_random_workload_keeps_invariants_and_the_index_agrees() -> None:
    """Events applied by the real ingest path leave the index holding exactly the pool's
    blocks, and the index predicts every admission's hits."""
    rng = random.Random(5)
    c = BlockPool(12, 4, ROOT)
    index, stream = MemoryIndex(), StreamId("r1")
    ingestor = Ingestor(index)
    seq = 0

    def apply(events: list[Event]) -> None:
        nonlocal seq
        ingestor.apply(stream, "m", EventBatch(seq, time.time(), 0, events))
        seq += 1

    prefixes = [[rng.randrange(100) for _ in range(12)] for _ in range(3)]
    for request_id in range(200):
        prompt = [*rng.choice(prefixes)[: rng.randrange(1, 13)], rng.randrange(100)]
        keys = block_keys("m", prompt, 4)
        predicted = index.longest_prefix(keys, [stream])[stream].num_blocks
        admission = c.admit(request_id, prompt, len(prompt) + 3)
        assert admission is not None
        assert admission.num_hit_blocks == min(predicted, (len(prompt) - 1) // 4)
        apply(admission.events)
        apply(c.cache_full_blocks(request_id, [*prompt, 1, 2, 3]))
        c.release(request_id)
        c.check()
        assert index.stats(stream).num_blocks == c.num_cached_blocks
    assert c.num_evicted > 0
