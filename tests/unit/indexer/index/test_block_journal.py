"""BlockJournal: what each stream holds per tier, parents first, with Dynamo's tokens hash."""

from __future__ import annotations

from kvindex.indexer.domain.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    StreamId,
    Tier,
)
from kvindex.indexer.index.block_journal import BlockJournal, Held, JournaledIndex, tokens_hash
from kvindex.indexer.index.memory import MemoryIndex

S = StreamId("r1")
TOKENS = list(range(100, 112))


def test_tokens_hash_is_dynamos() -> None:
    # ai-dynamo-runtime 1.6.1: compute_block_hash_for_seq(list(range(100, 104)), 4)
    assert tokens_hash([100, 101, 102, 103]) == 6320977984009303047


def test_a_lora_blocks_tokens_hash_is_dynamos_lora_aware_one() -> None:
    # ai-dynamo-runtime 1.6.1: compute_block_hash_for_seq(list(range(1, 9)), 4, lora_name=...)
    assert [tokens_hash([1, 2, 3, 4], "ad1"), tokens_hash([5, 6, 7, 8], "ad1")] == [
        4033386159037673140,
        689901486715976884,
    ]
    assert tokens_hash([1, 2, 3, 4], "b") == 16671564730209599978
    assert tokens_hash([1, 2, 3, 4], None) == 14643705804678351452


def test_lora_blocks_are_kept_with_their_lora_aware_tokens_hash() -> None:
    journal = BlockJournal()
    journal.observe(S, BlockStored([21, 22], None, TOKENS[:8], 4, Tier.GPU, lora_name="ad1"))
    lora_keys = [("ad1",), ("ad1",)]  # as vLLM sends a LoRA request's blocks
    journal.observe(S, BlockStored([23], 22, TOKENS[8:], 4, Tier.GPU, "ad1", lora_keys[:1]))
    assert journal.held(S)[Tier.GPU] == [
        Held(21, None, tokens_hash(TOKENS[:4], "ad1")),
        Held(22, 21, tokens_hash(TOKENS[4:8], "ad1")),
        Held(23, 22, tokens_hash(TOKENS[8:], "ad1")),
    ]
    assert tokens_hash(TOKENS[:4], "ad1") != tokens_hash(TOKENS[:4])


def test_blocks_with_extra_keys_dynamo_does_not_hash_are_left_out() -> None:
    journal = BlockJournal()
    salted = [("ad1", "salt"), ("ad1",)]  # a cache salt on the first block
    journal.observe(S, BlockStored([21, 22], None, TOKENS[:8], 4, Tier.GPU, "ad1", salted))
    journal.observe(S, BlockStored([31], None, TOKENS[:4], 4, Tier.GPU, "ad1", [("other",)]))
    journal.observe(S, BlockStored([41], None, TOKENS[:4], 4, Tier.GPU, None, [("ad1",)]))
    journal.observe(S, BlockStored([51], None, TOKENS[:4], 4, Tier.GPU, None, [None]))
    assert journal.held(S)[Tier.GPU] == [Held(51, None, tokens_hash(TOKENS[:4]))]


def test_stores_removals_and_clears_are_followed_per_tier() -> None:
    journal = BlockJournal()
    journal.observe(S, BlockStored([11, 12], None, TOKENS[:8], 4, Tier.GPU))
    journal.observe(S, BlockStored([13], 12, TOKENS[8:], 4, Tier.GPU))
    journal.observe(S, BlockStored([11], None, TOKENS[:4], 4, Tier.CPU))
    journal.observe(S, BlockStored([21], None, TOKENS[:4], 4, Tier.GPU, extra_keys=[("salt",)]))
    journal.observe(S, BlockRemoved([12], Tier.CPU))  # not on CPU: nothing
    held = journal.held(S)
    assert [h.block_hash for h in held[Tier.GPU]] == [11, 12, 13]
    assert held[Tier.GPU][2] == Held(13, 12, tokens_hash(TOKENS[8:]))
    assert held[Tier.CPU] == [Held(11, None, tokens_hash(TOKENS[:4]))]
    journal.observe(S, BlockRemoved([12], Tier.GPU))
    assert [h.block_hash for h in journal.held(S)[Tier.GPU]] == [11, 13]
    journal.observe(S, AllBlocksCleared())
    assert journal.held(S) == {} and journal.streams() == []


def test_a_parent_comes_before_its_child_whatever_the_arrival() -> None:
    journal = BlockJournal()
    journal.observe(S, BlockStored([12], 11, TOKENS[4:8], 4, Tier.GPU))
    journal.observe(S, BlockStored([11], None, TOKENS[:4], 4, Tier.GPU))
    assert [h.block_hash for h in journal.held(S)[Tier.GPU]] == [11, 12]


def test_the_index_clears_and_drops_the_journal_too() -> None:
    journal = BlockJournal()
    index = JournaledIndex(MemoryIndex(), journal)
    assert index.native_ingest is False
    for reset in (index.clear, index.drop):
        index.observe_event(S, BlockStored([11], None, TOKENS[:4], 4, Tier.GPU))
        reset(S)
        assert journal.streams() == []
