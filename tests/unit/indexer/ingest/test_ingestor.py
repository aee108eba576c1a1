"""Ingestor over a MemoryIndex: events → block keys → index operations."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvindex.indexer.domain.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    ExtraKeys,
    StreamId,
    Tier,
)
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.domain.keys import block_keys, chain_keys, tokens_to_bytes
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.ingest.ingestor import Ingestor, orphan_root

STREAM = StreamId("r1", 0)
MODEL = "m"
BLOCK = 4
TOKENS = list(range(100, 112))  # three blocks
"""A request's prompt; its engine hashes are 11, 12, 13."""


class CountingIndex(MemoryIndex):
    """A MemoryIndex that counts how often the ingestor asked it to resolve a parent."""

    def __init__(self) -> None:
        super().__init__()
        self.num_resolves = 0

    def resolve(self, stream: StreamId, engine_hashes: Sequence[int]) -> list[int | None]:
        self.num_resolves += 1
        return super().resolve(stream, engine_hashes)


@pytest.fixture
def index() -> CountingIndex:
    return CountingIndex()


@pytest.fixture
def ingestor(index: CountingIndex) -> Ingestor:
    return Ingestor(index)


def stored(
    hashes: Sequence[int],
    parent: int | None,
    tokens: Sequence[int],
    *,
    tier: Tier = Tier.GPU,
    block_size: int = BLOCK,
    lora_name: str | None = None,
    extra_keys: tuple[ExtraKeys, ...] | None = None,
    group_idx: int | None = None,
) -> BlockStored:
    return BlockStored(
        tuple(hashes), parent, list(tokens), block_size, tier, lora_name, extra_keys, group_idx
    )


def placeholder(hashes: Sequence[int]) -> BlockStored:
    """vLLM's CPU-offload store: no tokens, block size 0."""
    return BlockStored(tuple(hashes), None, [], 0, Tier.CPU)


def batch(seq: int, *events: Event, num_bad_events: int = 0) -> EventBatch:
    return EventBatch(seq, 1000.0 + seq, 0, events, num_bad_events)


def keys_of(index: MemoryIndex, hashes: Sequence[int]) -> list[int | None]:
    return index.resolve(STREAM, list(hashes))


def tiers_matched(index: MemoryIndex, keys: Sequence[int]) -> tuple[Tier, ...]:
    return index.longest_prefix(keys, [STREAM])[STREAM].tiers


# --- chains ---------------------------------------------------------------------------


def test_root_chain_keys_equal_block_keys(index: CountingIndex, ingestor: Ingestor) -> None:
    report = ingestor.apply(STREAM, MODEL, batch(0, stored([11, 12, 13], None, TOKENS)))
    assert report == StreamReport(applied=True, num_blocks_stored=3, block_size=BLOCK)
    expected = block_keys(MODEL, TOKENS, BLOCK)
    assert keys_of(index, [11, 12, 13]) == expected
    assert tiers_matched(index, expected) == (Tier.GPU,) * 3


def test_parent_stored_in_the_same_batch_resolves(index: CountingIndex, ingestor: Ingestor) -> None:
    first = stored([11], None, TOKENS[:4])
    rest = stored([12, 13], 11, TOKENS[4:])
    report = ingestor.apply(STREAM, MODEL, batch(0, first, rest))
    assert (report.num_orphan_stores, index.num_resolves) == (0, 0)
    assert keys_of(index, [11, 12, 13]) == block_keys(MODEL, TOKENS, BLOCK)


def test_parent_from_an_earlier_batch_resolves_through_the_cache(
    index: CountingIndex, ingestor: Ingestor
) -> None:
    ingestor.apply(STREAM, MODEL, batch(0, stored([11, 12], None, TOKENS[:8])))
    report = ingestor.apply(STREAM, MODEL, batch(1, stored([13], 12, TOKENS[8:])))
    assert (report.num_orphan_stores, index.num_resolves) == (0, 0)
    assert keys_of(index, [13]) == block_keys(MODEL, TOKENS, BLOCK)[2:]


def test_parent_resolves_through_the_index_after_forget(
    index: CountingIndex, ingestor: Ingestor
) -> None:
    ingestor.apply(STREAM, MODEL, batch(0, stored([11, 12], None, TOKENS[:8])))
    ingestor.forget(STREAM)
    report = ingestor.apply(STREAM, MODEL, batch(1, stored([13], 12, TOKENS[8:])))
    assert (report.num_orphan_stores, index.num_resolves) == (0, 1)
    assert keys_of(index, [13]) == block_keys(MODEL, TOKENS, BLOCK)[2:]


def test_key_cache_keeps_a_parent_in_use_and_lets_idle_ones_go(index: CountingIndex) -> None:
    """Two generations of two mappings each: a parent read again moves back to the young
    one and survives ageing; one not read since falls back to the index (still right)."""
    ingestor = Ingestor(index, cache_size=4)
    tokens = list(range(1000, 1000 + 64))
    ingestor.apply(STREAM, MODEL, batch(0, stored([11], None, tokens[:4])))  # hot parent
    ingestor.apply(STREAM, MODEL, batch(1, stored([21], None, tokens[4:8])))  # idle parent
    seq = 2
    for child in range(100, 106):  # each child is chained from 11 and fills the cache
        ingestor.apply(STREAM, MODEL, batch(seq, stored([child], 11, tokens[8:12])))
        filler = stored([child + 50], None, tokens[12 + 4 * (child - 100) :][:4])
        ingestor.apply(STREAM, MODEL, batch(seq + 1, filler))
        seq += 2
    assert index.num_resolves == 0  # 11 stayed in the cache all along
    report = ingestor.apply(STREAM, MODEL, batch(seq, stored([31], 21, tokens[8:12])))
    assert (report.num_orphan_stores, index.num_resolves) == (0, 1)  # 21 came from the index
    parent_21 = keys_of(index, [21])[0]
    assert parent_21 is not None
    assert keys_of(index, [31]) == chain_keys(parent_21, tokens_to_bytes(tokens[8:12]), BLOCK)


def test_streams_do_not_share_parents(index: CountingIndex, ingestor: Ingestor) -> None:
    ingestor.apply(STREAM, MODEL, batch(0, stored([11], None, TOKENS[:4])))
    other = StreamId("r2", 0)
    report = ingestor.apply(other, MODEL, batch(0, stored([12], 11, TOKENS[4:8])))
    assert report.num_orphan_stores == 1


# --- orphans --------------------------------------------------------------------------


def test_unknown_parent_is_kept_as_an_orphan_off_every_real_chain(
    index: CountingIndex, ingestor: Ingestor
) -> None:
    report = ingestor.apply(STREAM, MODEL, batch(0, stored([12, 13], 11, TOKENS[4:])))
    assert (report.num_orphan_stores, report.num_blocks_stored) == (1, 2)
    orphan_keys = chain_keys(orphan_root(11), tokens_to_bytes(TOKENS[4:]), BLOCK)
    assert keys_of(index, [12, 13]) == orphan_keys
    real_keys = block_keys(MODEL, TOKENS, BLOCK)
    assert not set(orphan_keys) & set(real_keys)
    assert not set(orphan_keys) & set(block_keys(MODEL, TOKENS[4:], BLOCK))
    assert tiers_matched(index, real_keys) == ()


def test_children_of_an_orphan_chain_from_it(index: CountingIndex, ingestor: Ingestor) -> None:
    ingestor.apply(STREAM, MODEL, batch(0, stored([12], 11, TOKENS[4:8])))
    report = ingestor.apply(STREAM, MODEL, batch(1, stored([13], 12, TOKENS[8:])))
    assert report.num_orphan_stores == 0
    orphan_keys = chain_keys(orphan_root(11), tokens_to_bytes(TOKENS[4:]), BLOCK)
    assert keys_of(index, [12, 13]) == orphan_keys


def test_an_orphan_can_be_removed(index: CountingIndex, ingestor: Ingestor) -> None:
    ingestor.apply(STREAM, MODEL, batch(0, stored([12], 11, TOKENS[4:8])))
    report = ingestor.apply(STREAM, MODEL, batch(1, BlockRemoved((12,), Tier.GPU)))
    assert (report.num_blocks_removed, report.num_unknown_removals) == (1, 0)
    assert keys_of(index, [12]) == [None]
    assert index.stats(STREAM).num_blocks == 0


# --- skipped and bad events -----------------------------------------------------------


def test_misaligned_token_count_is_counted_and_skipped(
    index: CountingIndex, ingestor: Ingestor
) -> None:
    short = stored([21, 22], None, TOKENS[:7])
    good = stored([11], None, TOKENS[:4])
    report = ingestor.apply(STREAM, MODEL, batch(0, short, good))
    assert (report.num_misaligned_events, report.num_blocks_stored) == (1, 1)
    assert keys_of(index, [21, 22, 11]) == [None, None, block_keys(MODEL, TOKENS, BLOCK)[0]]


def test_extra_keys_not_one_per_block_are_misaligned(
    index: CountingIndex, ingestor: Ingestor
) -> None:
    event = stored([11, 12], None, TOKENS[:8], extra_keys=(("salt",),))
    report = ingestor.apply(STREAM, MODEL, batch(0, event))
    assert (report.num_misaligned_events, report.num_blocks_stored) == (1, 0)
    assert keys_of(index, [11, 12]) == [None, None]


def test_other_kv_cache_groups_are_skipped_and_counted(
    index: CountingIndex, ingestor: Ingestor
) -> None:
    events: tuple[Event, ...] = (
        stored([31], None, TOKENS[:4], group_idx=1),
        BlockRemoved((31,), Tier.GPU, group_idx=1),
        stored([11], None, TOKENS[:4], group_idx=0),
    )
    report = ingestor.apply(STREAM, MODEL, batch(0, *events))
    assert report.num_skipped_group_events == 2
    assert (report.num_blocks_stored, report.num_blocks_removed) == (1, 0)
    assert keys_of(index, [31, 11]) == [None, block_keys(MODEL, TOKENS, BLOCK)[0]]


def test_bad_token_ids_are_counted_without_losing_the_batch(
    index: CountingIndex, ingestor: Ingestor
) -> None:
    bad = stored([21], None, [1, -2, 3, 4])
    good = stored([11], None, TOKENS[:4])
    report = ingestor.apply(STREAM, MODEL, batch(0, bad, good, num_bad_events=2))
    assert report.num_bad_events == 3  # two undecodable on the wire, one here
    assert report.applied
    assert keys_of(index, [21, 11]) == [None, block_keys(MODEL, TOKENS, BLOCK)[0]]


def test_bad_token_ids_under_an_unknown_parent_are_not_an_orphan(
    index: CountingIndex, ingestor: Ingestor
) -> None:
    report = ingestor.apply(STREAM, MODEL, batch(0, stored([21], 99, [1, -2, 3, 4])))
    assert (report.num_bad_events, report.num_orphan_stores) == (1, 0)


def test_removal_of_an_unknown_hash_is_counted(index: CountingIndex, ingestor: Ingestor) -> None:
    report = ingestor.apply(STREAM, MODEL, batch(0, BlockRemoved((77,), Tier.GPU)))
    assert report.applied
    assert (report.num_blocks_removed, report.num_unknown_removals) == (1, 1)


# --- CPU placeholders -----------------------------------------------------------------


def test_cpu_placeholder_resolves_through_the_engine_hash(
    index: CountingIndex, ingestor: Ingestor
) -> None:
    keys = block_keys(MODEL, TOKENS[:8], BLOCK)
    ingestor.apply(STREAM, MODEL, batch(0, stored([11, 12], None, TOKENS[:8])))
    report = ingestor.apply(STREAM, MODEL, batch(1, placeholder([11, 12])))
    assert (report.num_blocks_stored, report.num_unresolved_stores) == (2, 0)
    assert index.stats(STREAM).blocks_by_tier == {Tier.GPU: 2, Tier.CPU: 2, Tier.OTHER: 0}
    assert tiers_matched(index, keys) == (Tier.GPU, Tier.GPU)

    ingestor.apply(STREAM, MODEL, batch(2, BlockRemoved((11, 12), Tier.GPU)))
    assert tiers_matched(index, keys) == (Tier.CPU, Tier.CPU)
    assert index.stats(STREAM).blocks_by_tier == {Tier.GPU: 0, Tier.CPU: 2, Tier.OTHER: 0}


def test_cpu_placeholder_for_an_unknown_hash_is_unresolved(
    index: CountingIndex, ingestor: Ingestor
) -> None:
    report = ingestor.apply(STREAM, MODEL, batch(0, placeholder([55])))
    assert report.applied
    assert report.num_unresolved_stores == 1
    assert index.stats(STREAM).num_blocks == 0


# --- extra keys -----------------------------------------------------------------------


def test_lora_name_without_extra_keys_is_on_every_block(
    index: CountingIndex, ingestor: Ingestor
) -> None:
    event = stored([11, 12, 13], None, TOKENS, lora_name="ad1")
    ingestor.apply(STREAM, MODEL, batch(0, event))
    expected = block_keys(MODEL, TOKENS, BLOCK, lora_name="ad1")
    assert keys_of(index, [11, 12, 13]) == expected
    assert not set(expected) & set(block_keys(MODEL, TOKENS, BLOCK))


def test_extra_keys_with_a_salt_on_the_first_block(
    index: CountingIndex, ingestor: Ingestor
) -> None:
    event = stored([11, 12, 13], None, TOKENS, extra_keys=(("s1",), None, None))
    ingestor.apply(STREAM, MODEL, batch(0, event))
    expected = block_keys(MODEL, TOKENS, BLOCK, cache_salt="s1")
    assert keys_of(index, [11, 12, 13]) == expected
    assert expected[0] != block_keys(MODEL, TOKENS, BLOCK)[0]


def test_extra_keys_with_lora_and_salt(index: CountingIndex, ingestor: Ingestor) -> None:
    extra: tuple[ExtraKeys, ...] = (("ad1", "s1"), ("ad1",), ("ad1",))
    event = stored([11, 12, 13], None, TOKENS, lora_name="ad1", extra_keys=extra)
    ingestor.apply(STREAM, MODEL, batch(0, event))
    expected = block_keys(MODEL, TOKENS, BLOCK, lora_name="ad1", cache_salt="s1")
    assert keys_of(index, [11, 12, 13]) == expected


def test_extra_keys_all_none_mean_none(index: CountingIndex, ingestor: Ingestor) -> None:
    event = stored([11, 12, 13], None, TOKENS, extra_keys=(None, None, None))
    ingestor.apply(STREAM, MODEL, batch(0, event))
    assert keys_of(index, [11, 12, 13]) == block_keys(MODEL, TOKENS, BLOCK)


# --- clears and the watermark ---------------------------------------------------------


def test_all_blocks_cleared_clears_the_stream(index: CountingIndex, ingestor: Ingestor) -> None:
    ingestor.apply(STREAM, MODEL, batch(0, stored([11, 12, 13], None, TOKENS)))
    ingestor.apply(STREAM, MODEL, batch(1, placeholder([11])))
    report = ingestor.apply(STREAM, MODEL, batch(2, AllBlocksCleared()))
    assert (report.applied, report.num_clears) == (True, 1)
    assert tiers_matched(index, block_keys(MODEL, TOKENS, BLOCK)) == ()
    assert index.stats(STREAM).num_blocks == 0
    assert index.stats(STREAM).watermark == 2


def test_batch_at_or_below_the_watermark_is_not_applied(
    index: CountingIndex, ingestor: Ingestor
) -> None:
    event = stored([11], None, TOKENS[:4])
    assert ingestor.apply(STREAM, MODEL, batch(5, event)).applied
    assert not ingestor.apply(STREAM, MODEL, batch(5, event)).applied
    assert not ingestor.apply(STREAM, MODEL, batch(3, AllBlocksCleared())).applied
    # the replayed store was not counted twice: one removal drops the block
    ingestor.apply(STREAM, MODEL, batch(6, BlockRemoved((11,), Tier.GPU)))
    assert index.stats(STREAM).num_blocks == 0
    assert index.stats(STREAM).watermark == 6
