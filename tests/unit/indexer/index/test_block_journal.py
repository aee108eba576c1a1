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


def test_stores_removals_and_clears_are_followed_per_tier() -> None:
    journal = BlockJournal()
    journal.observe(S, BlockStored([11, 12], None, TOKENS[:8], 4, Tier.GPU))
    journal.observe(S, BlockStored([13], 12, TOKENS[8:], 4, Tier.GPU))
    journal.observe(S, BlockStored([11], None, TOKENS[:4], 4, Tier.CPU))
    journal.observe(S, BlockStored([21], None, TOKENS[:4], 4, Tier.GPU, lora_name="a"))
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
