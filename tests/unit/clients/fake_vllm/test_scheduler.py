"""The offline scheduler: steps that respect vLLM's limits, events the indexer agrees with."""

from __future__ import annotations

import itertools
import random

import pytest

from kvindex.clients.fake_vllm.block_pool import BlockPool
from kvindex.clients.fake_vllm.scheduler import STEP_BASE_S, STEP_PER_TOKEN_S, StepScheduler
from kvindex.clients.workloads.chats import ChatSessions, chat_system_prompts
from kvindex.indexer.domain.events import BlockRemoved, BlockStored, Event, EventBatch, StreamId
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.ingest.ingestor import Ingestor

CAPACITY = 600
"""Blocks: more than the longest chat turn needs (6,144 + 768 + 512 tokens)."""
BUDGET = 1_024


def scheduler(seed: int = 1, capacity: int = CAPACITY) -> tuple[StepScheduler, BlockPool]:
    rng = random.Random(seed)
    pool = BlockPool(capacity, 16, root=seed)
    chats = ChatSessions(rng, chat_system_prompts(seed, 3), max_idle=8)
    return StepScheduler(pool, chats, max_running=8, max_batched_tokens=BUDGET), pool


def run(steps: StepScheduler, num_blocks: int) -> list[tuple[float, list[Event]]]:
    batches = steps.batches(0.0)
    out = []
    while steps.num_blocks_stored < num_blocks:
        out.append(next(batches))
    return out


def test_the_same_seed_publishes_the_same_batches() -> None:
    first, _ = scheduler()
    again, _ = scheduler()
    other, _ = scheduler(seed=2)
    assert run(first, 500) == run(again, 500) != run(other, 500)


def test_steps_stay_within_the_token_budget_and_take_engine_time() -> None:
    steps, pool = scheduler()
    for _ in range(200):
        _, num_tokens = steps.step()
        assert 0 < num_tokens <= BUDGET
        pool.check()
    (ts, _), (later, _) = itertools.islice(steps.batches(10.0), 2)
    assert later - ts >= STEP_BASE_S + STEP_PER_TOKEN_S


def test_a_long_prompt_is_stored_over_several_steps_chained_to_its_parent() -> None:
    steps, _ = scheduler()
    first_batches = run(steps, 100)
    stores = [e for _, events in first_batches for e in events if isinstance(e, BlockStored)]
    assert all(len(e.block_hashes) <= BUDGET // 16 for e in stores)
    parents = {e.parent_hash for e in stores} - {None}
    stored = {h for e in stores for h in e.block_hashes}
    assert parents <= stored  # every chunk after the first continues a stored chain


def test_the_index_fed_every_event_holds_exactly_the_pools_blocks() -> None:
    steps, pool = scheduler()
    index, stream = MemoryIndex(), StreamId("r1")
    ingestor = Ingestor(index)
    num_orphans = 0
    for seq, (ts, events) in enumerate(run(steps, 3 * CAPACITY)):
        report = ingestor.apply(stream, "m", EventBatch(seq, ts, 0, events))
        num_orphans += report.num_orphan_stores + report.num_unknown_removals
    assert num_orphans == 0
    assert pool.num_evicted > 0  # the pool filled up and turned over
    assert index.stats(stream).num_blocks == pool.num_cached_blocks
    assert 0 < steps.num_prompt_blocks_hit < steps.num_prompt_blocks  # chats hit their history


def test_evictions_are_published_one_block_at_a_time() -> None:
    steps, pool = scheduler()
    removals = [e for _, events in run(steps, 2 * CAPACITY) for e in events]
    removed = [e for e in removals if isinstance(e, BlockRemoved)]
    assert len(removed) == pool.num_evicted > 0
    assert all(len(e.block_hashes) == 1 for e in removed)


def test_a_request_larger_than_the_pool_is_an_error() -> None:
    steps, _ = scheduler(capacity=8)
    with pytest.raises(RuntimeError, match="more blocks than the whole cache"):
        steps.step()
