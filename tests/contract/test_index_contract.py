"""The block index contract (``indexer/index.py``), checked identically on every backend.

The closing property test replays random batches on a backend and on a small reference
model written here from the Protocol's docstrings, and compares every answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.index.protocol import (
    NO_MATCH,
    SKIPPED,
    ApplyResult,
    BlockIndex,
    Op,
    OpKind,
    PrefixMatch,
    StoreIdentity,
    StreamStats,
    drop_replica,
    holders_of,
    prefix_holders,
)
from tests.contract.conftest import IndexFactory

GPU, CPU, OTHER = Tier.GPU, Tier.CPU, Tier.OTHER
S = StreamId("r1", 0)
S_RANK1 = StreamId("r1", 1)
S_OTHER = StreamId("r2", 0)
MAX_U64 = 2**64 - 1


def store(engine_hash: int, key: int, tier: Tier = GPU) -> Op:
    return (OpKind.STORE, tier, engine_hash, key)


def store_by_hash(engine_hash: int, tier: Tier = CPU) -> Op:
    return (OpKind.STORE_BY_HASH, tier, engine_hash, 0)


def remove(engine_hash: int, tier: Tier = GPU) -> Op:
    return (OpKind.REMOVE, tier, engine_hash, 0)


CLEAR_OP: Op = (OpKind.CLEAR, GPU, 0, 0)


def tiers(index: BlockIndex, keys: Sequence[int], stream: StreamId = S) -> tuple[Tier, ...]:
    return index.longest_prefix(keys, [stream])[stream].tiers


def by_tier(gpu: int = 0, cpu: int = 0, other: int = 0) -> dict[Tier, int]:
    return {GPU: gpu, CPU: cpu, OTHER: other}


def seed(index: BlockIndex, stream: StreamId = S, seq: int = 0) -> None:
    """Blocks 101, 102, 103 (engine hashes 1, 2, 3) on GPU."""
    index.apply(stream, seq, 1.0, [store(1, 101), store(2, 102), store(3, 103)])


# --- apply and the watermark -------------------------------------------------------------


def test_apply_stores_and_longest_prefix_finds(index: BlockIndex) -> None:
    result = index.apply(S, 0, 1.0, [store(1, 101), store(2, 102, CPU), store(3, 103, OTHER)])
    assert result == ApplyResult(applied=True)
    assert tiers(index, [101, 102, 103]) == (GPU, CPU, OTHER)
    assert index.longest_prefix([101, 102], [S])[S].num_blocks == 2


def test_full_u64_range_round_trips(index: BlockIndex) -> None:
    index.apply(S, 0, 1.0, [store(MAX_U64, MAX_U64), store(0, 0)])
    assert tiers(index, [MAX_U64, 0]) == (GPU, GPU)
    assert index.resolve(S, [MAX_U64, 0]) == [MAX_U64, 0]


def test_same_seq_twice_is_a_noop(index: BlockIndex) -> None:
    seed(index, seq=5)
    assert index.apply(S, 5, 9.0, [remove(1), store(4, 104)]) == SKIPPED
    assert tiers(index, [101, 102, 103, 104]) == (GPU, GPU, GPU)
    assert index.stats(S) == StreamStats(S, 5, 1.0, by_tier(gpu=3))


def test_lower_seq_is_a_noop(index: BlockIndex) -> None:
    seed(index, seq=5)
    assert index.apply(S, 4, 9.0, [CLEAR_OP]) == SKIPPED
    assert index.apply(S, -1, 9.0, [remove(1)]) == SKIPPED
    assert tiers(index, [101, 102, 103]) == (GPU, GPU, GPU)
    assert index.stats(S).watermark == 5


@pytest.mark.parametrize("high", [2**53, 2**63, 2**64 - 2])
def test_seqs_beyond_a_double_s_precision_stay_exact_integers(index: BlockIndex, high: int) -> None:
    seed(index, seq=high)
    assert index.apply(S, high - 1, 9.0, [remove(1)]) == SKIPPED  # equal as doubles
    assert index.apply(S, high, 9.0, [remove(1)]) == SKIPPED
    stats = index.stats(S)
    assert (stats.watermark, type(stats.watermark)) == (high, int)
    assert index.apply(S, high + 1, 9.0, [remove(1)]).applied
    assert index.stats(S).watermark == high + 1
    assert tiers(index, [101]) == ()


def test_higher_seq_applies_across_a_gap(index: BlockIndex) -> None:
    seed(index, seq=0)
    assert index.apply(S, 10, 2.0, [remove(1)]).applied
    assert index.stats(S).watermark == 10
    assert tiers(index, [101]) == ()


def test_empty_batch_moves_watermark(index: BlockIndex) -> None:
    assert index.apply(S, 3, 4.5, []) == ApplyResult(applied=True)
    assert index.stats(S) == StreamStats(S, 3, 4.5, by_tier())


def test_stats_report_watermark_and_last_event_ts(index: BlockIndex) -> None:
    index.apply(S, 0, 1_700_000_000.125, [store(1, 101)])
    index.apply(S, 1, 1_700_000_001.5, [store(2, 102, CPU)])
    stats = index.stats(S)
    assert (stats.watermark, stats.last_event_ts) == (1, 1_700_000_001.5)
    assert stats.blocks_by_tier == by_tier(gpu=1, cpu=1)
    assert stats.num_blocks == 2


def test_stats_of_unknown_stream_are_empty(index: BlockIndex) -> None:
    assert index.stats(S) == StreamStats(S, -1, None, by_tier())
    assert index.stats(S).num_blocks == 0


def test_two_indexers_on_one_stream_apply_each_batch_once(index: BlockIndex) -> None:
    num_batches = 60
    batches = [(seq, [store(1, 101), store(seq + 10, seq + 1000)]) for seq in range(num_batches)]

    def run(_: int) -> int:
        return sum(index.apply(S, seq, 1.0, ops).applied for seq, ops in batches)

    with ThreadPoolExecutor(max_workers=3) as pool:
        assert sum(pool.map(run, range(3))) == num_batches
    assert index.stats(S).blocks_by_tier == by_tier(gpu=num_batches + 1)
    removals = [remove(1)] * (num_batches + 1)
    assert index.apply(S, num_batches, 1.0, removals).num_unknown_removals == 1


# --- counts per (stream, block, tier) ------------------------------------------------------


def test_duplicate_store_needs_two_removals(index: BlockIndex) -> None:
    index.apply(S, 0, 1.0, [store(1, 101), store(1, 101)])
    assert index.stats(S).blocks_by_tier == by_tier(gpu=1)
    index.apply(S, 1, 1.0, [remove(1)])
    assert tiers(index, [101]) == (GPU,)
    assert index.apply(S, 2, 1.0, [remove(1)]) == ApplyResult(applied=True)
    assert tiers(index, [101]) == ()
    assert index.apply(S, 3, 1.0, [remove(1)]).num_unknown_removals == 1


def test_tiers_are_tracked_apart(index: BlockIndex) -> None:
    index.apply(S, 0, 1.0, [store(1, 101, GPU), store(1, 101, CPU)])
    assert index.stats(S).blocks_by_tier == by_tier(gpu=1, cpu=1)
    index.apply(S, 1, 1.0, [remove(1, CPU)])
    assert tiers(index, [101]) == (GPU,)
    index.apply(S, 2, 1.0, [store(1, 101, CPU), remove(1, GPU)])
    assert tiers(index, [101]) == (CPU,)
    assert index.resolve(S, [1]) == [101]
    index.apply(S, 3, 1.0, [remove(1, CPU)])
    assert tiers(index, [101]) == ()


@pytest.mark.parametrize(
    ("held", "best"),
    [
        ((OTHER,), OTHER),
        ((CPU,), CPU),
        ((OTHER, CPU), CPU),
        ((OTHER, GPU), GPU),
        ((CPU, GPU), GPU),
        ((OTHER, CPU, GPU), GPU),
    ],
)
def test_best_tier_is_gpu_then_cpu_then_other(
    index: BlockIndex, held: tuple[Tier, ...], best: Tier
) -> None:
    index.apply(S, 0, 1.0, [store(1, 101, tier) for tier in held])
    assert tiers(index, [101]) == (best,)


def test_store_by_hash_resolves_through_engine_hash_map(index: BlockIndex) -> None:
    index.apply(S, 0, 1.0, [store(1, 101, GPU)])
    assert index.apply(S, 1, 1.0, [store_by_hash(1, CPU)]) == ApplyResult(applied=True)
    assert index.stats(S).blocks_by_tier == by_tier(gpu=1, cpu=1)
    index.apply(S, 2, 1.0, [remove(1, GPU)])
    assert tiers(index, [101]) == (CPU,)


def test_store_by_hash_sees_a_store_earlier_in_its_batch(index: BlockIndex) -> None:
    result = index.apply(S, 0, 1.0, [store(1, 101, GPU), store_by_hash(1, OTHER)])
    assert result == ApplyResult(applied=True)
    assert index.stats(S).blocks_by_tier == by_tier(gpu=1, other=1)


def test_store_by_unknown_hash_is_counted_unresolved(index: BlockIndex) -> None:
    seed(index)
    result = index.apply(S, 1, 1.0, [store_by_hash(7), store_by_hash(8), store_by_hash(2)])
    assert result == ApplyResult(applied=True, num_unresolved_stores=2)
    assert index.stats(S).blocks_by_tier == by_tier(gpu=3, cpu=1)
    assert index.resolve(S, [7, 8]) == [None, None]


def test_remove_of_unknown_hash_is_counted_and_changes_nothing(index: BlockIndex) -> None:
    seed(index)
    result = index.apply(S, 1, 2.0, [remove(9), remove(10, CPU)])
    assert result == ApplyResult(applied=True, num_unknown_removals=2)
    assert tiers(index, [101, 102, 103]) == (GPU, GPU, GPU)
    assert index.stats(S) == StreamStats(S, 1, 2.0, by_tier(gpu=3))


def test_remove_of_tier_not_held_is_counted_and_changes_nothing(index: BlockIndex) -> None:
    seed(index)
    result = index.apply(S, 1, 1.0, [remove(1, CPU), remove(2, OTHER)])
    assert result == ApplyResult(applied=True, num_unknown_removals=2)
    assert tiers(index, [101, 102, 103]) == (GPU, GPU, GPU)
    assert index.stats(S).blocks_by_tier == by_tier(gpu=3)
    assert index.resolve(S, [1, 2]) == [101, 102]


def test_removing_a_block_forgets_its_engine_hash(index: BlockIndex) -> None:
    seed(index)
    index.apply(S, 1, 1.0, [remove(2)])
    assert index.resolve(S, [1, 2, 3]) == [101, None, 103]
    assert index.apply(S, 2, 1.0, [store_by_hash(2)]).num_unresolved_stores == 1


# --- CLEAR op, clear(), drop() ------------------------------------------------------------


def test_clear_op_wipes_blocks_and_moves_watermark(index: BlockIndex) -> None:
    seed(index)
    assert index.apply(S, 1, 2.0, [CLEAR_OP]) == ApplyResult(applied=True)
    assert tiers(index, [101]) == ()
    assert index.stats(S) == StreamStats(S, 1, 2.0, by_tier())
    assert index.resolve(S, [1, 2, 3]) == [None, None, None]
    assert index.apply(S, 1, 3.0, [store(1, 101)]) == SKIPPED


def test_ops_after_clear_op_in_same_batch_apply(index: BlockIndex) -> None:
    seed(index)
    ops = [store(4, 104, CPU), CLEAR_OP, store(5, 105), store_by_hash(5, OTHER), remove(1)]
    result = index.apply(S, 1, 2.0, ops)
    assert result == ApplyResult(applied=True, num_unknown_removals=1)
    assert tiers(index, [105, 101]) == (GPU,)
    assert tiers(index, [104]) == ()
    assert index.stats(S).blocks_by_tier == by_tier(gpu=1, other=1)


def test_clear_wipes_blocks_and_resets_watermark(index: BlockIndex) -> None:
    seed(index, seq=7)
    index.clear(S)
    assert index.stats(S) == StreamStats(S, -1, None, by_tier())
    assert tiers(index, [101]) == ()
    assert index.resolve(S, [1]) == [None]
    assert index.streams() == [S]
    assert index.apply(S, 0, 3.0, [store(2, 102)]).applied
    assert tiers(index, [102]) == (GPU,)


@pytest.mark.parametrize("how", ["clear", "clear op", "drop"])
def test_a_key_whose_engine_hash_was_stored_again_with_another_is_still_cleared(
    index: BlockIndex, how: str
) -> None:
    # Engine hash 1 maps to 201 now, so no mapping names 101, which the stream still holds:
    # a clear must find it anyway (the Redis store keeps such keys aside for this).
    index.apply(S, 0, 1.0, [store(1, 101), store(1, 201)])
    index.apply(S, 1, 1.0, [store(2, 102), store(2, 202, CPU)])
    assert tiers(index, [101]) == (GPU,)
    if how == "clear":
        index.clear(S)
    elif how == "clear op":
        index.apply(S, 2, 2.0, [CLEAR_OP])
    else:
        index.drop(S)
    assert [tiers(index, [k]) for k in (101, 201, 102, 202)] == [()] * 4
    assert index.stats(S).blocks_by_tier == by_tier()
    index.apply(S, 3, 3.0, [store(3, 103)])
    assert tiers(index, [101]) == () and tiers(index, [103]) == (GPU,)


def test_streams_sharing_blocks_each_get_their_own_tiers_and_end(index: BlockIndex) -> None:
    # Many holders of the same blocks on different tiers, some holding them twice, some
    # leaving part of them: each answer is its own stream's.
    keys = list(range(3001, 3011))
    streams = [StreamId(f"s{i:02d}", i % 3) for i in range(48)]
    for i, stream in enumerate(streams):
        tier = (GPU, CPU, OTHER)[i % 3]
        ops = [store(k, k, tier) for k in keys] + [store(k, k, GPU) for k in keys[: i % 4]]
        index.apply(stream, 0, 1.0, ops)
        index.apply(stream, 1, 1.0, [remove(keys[i % 10], tier)] if i % 5 == 0 else [])
    found = index.longest_prefix(keys, streams)
    for i, stream in enumerate(streams):
        tier = (GPU, CPU, OTHER)[i % 3]
        own = [GPU if j < i % 4 else tier for j in range(10)]
        if i % 5 == 0 and i % 10 >= i % 4:  # the removal left the block without a holder
            own = own[: i % 10]
        assert found[stream] == PrefixMatch(tuple(own)), stream


def test_clear_of_unknown_stream_is_harmless(index: BlockIndex) -> None:
    seed(index, stream=S_OTHER)
    index.clear(S)
    assert index.stats(S) == StreamStats(S, -1, None, by_tier())
    assert index.streams() == [S_OTHER]


def test_drop_forgets_the_stream(index: BlockIndex) -> None:
    seed(index, seq=4)
    seed(index, stream=S_OTHER)
    index.drop(S)
    assert index.streams() == [S_OTHER]
    assert index.stats(S) == StreamStats(S, -1, None, by_tier())
    assert index.longest_prefix([101], [S, S_OTHER]) == {S: NO_MATCH, S_OTHER: PrefixMatch((GPU,))}
    assert index.resolve(S, [1]) == [None]
    assert index.apply(S, 0, 1.0, [store(1, 101)]).applied
    assert index.streams() == [S, S_OTHER]


def test_drop_of_unknown_stream_is_harmless(index: BlockIndex) -> None:
    seed(index)
    index.drop(S_OTHER)
    assert index.streams() == [S]
    assert tiers(index, [101]) == (GPU,)


def test_drop_replica_drops_all_its_ranks_only(index: BlockIndex) -> None:
    look_alike = StreamId("r10", 0)
    for stream in (S, S_RANK1, S_OTHER, look_alike):
        seed(index, stream=stream)
    assert drop_replica(index, "r1") == [S, S_RANK1]
    assert index.streams() == [look_alike, S_OTHER]
    found = index.longest_prefix([101], [S, S_RANK1, S_OTHER, look_alike])
    assert [m.num_blocks for m in found.values()] == [0, 0, 1, 1]
    assert drop_replica(index, "r1") == []


# --- streams ------------------------------------------------------------------------------


def test_a_store_that_keeps_its_data_stays_intact(index: BlockIndex) -> None:
    assert isinstance(index, StoreIdentity)
    assert index.intact()
    index.apply(S, 0, 1.0, [store(1, 101)])
    index.clear(S)
    index.apply(S_OTHER, 0, 1.0, [store(1, 101)])
    index.drop(S_OTHER)
    assert index.intact() and index.intact()


def test_streams_lists_every_stream_sorted(index: BlockIndex) -> None:
    assert index.streams() == []
    for stream in (S_OTHER, S_RANK1, S):
        index.apply(stream, 0, 1.0, [])
    assert index.streams() == [S, S_RANK1, S_OTHER]


def test_streams_of_two_replicas_are_independent(index: BlockIndex) -> None:
    index.apply(S, 9, 1.0, [store(1, 101)])
    index.apply(S_OTHER, 0, 2.0, [store(1, 201, CPU)])
    assert index.resolve(S, [1]) == [101]
    assert index.resolve(S_OTHER, [1]) == [201]
    index.apply(S_OTHER, 1, 3.0, [remove(1, CPU)])
    assert tiers(index, [101]) == (GPU,)
    assert index.stats(S) == StreamStats(S, 9, 1.0, by_tier(gpu=1))
    assert index.stats(S_OTHER) == StreamStats(S_OTHER, 1, 3.0, by_tier())


def test_ranks_of_one_replica_are_independent(index: BlockIndex) -> None:
    seed(index, stream=S, seq=50)
    assert index.apply(S_RANK1, 0, 1.0, [store(1, 101, CPU)]).applied
    index.apply(S_RANK1, 1, 1.0, [CLEAR_OP])
    assert tiers(index, [101, 102], S) == (GPU, GPU)
    assert tiers(index, [101], S_RANK1) == ()
    index.clear(S_RANK1)
    assert index.stats(S).watermark == 50
    assert index.stats(S_RANK1).watermark == -1


# --- longest_prefix and resolve -----------------------------------------------------------


def test_longest_prefix_stops_at_first_miss(index: BlockIndex) -> None:
    seed(index)
    assert tiers(index, [101, 999, 102, 103]) == (GPU,)
    assert tiers(index, [999, 101, 102]) == ()
    assert tiers(index, [101, 102, 103, 104]) == (GPU, GPU, GPU)


def test_longest_prefix_answers_every_requested_stream(index: BlockIndex) -> None:
    seed(index, stream=S)
    index.apply(S_OTHER, 0, 1.0, [store(1, 101, CPU)])
    unknown = StreamId("nobody", 3)
    found = index.longest_prefix([101, 102], iter([S, S_OTHER, unknown]))
    assert found == {S: PrefixMatch((GPU, GPU)), S_OTHER: PrefixMatch((CPU,)), unknown: NO_MATCH}


def test_longest_prefix_over_many_streams_answers_each(index: BlockIndex) -> None:
    # Streams over many Redis groups (and more than a v1 script call walked), each holding a
    # different prefix of the keys, in an order that is not the streams' sort order.
    keys = list(range(1001, 1081))
    streams = [StreamId(f"r{i:03d}", i % 2) for i in range(79, -1, -1)]
    for i, stream in enumerate(streams):
        held = keys[: i % 9]
        index.apply(stream, 0, 1.0, [store(k, k, OTHER if i % 5 == 0 else GPU) for k in held])
    found = index.longest_prefix(keys, streams)
    assert list(found) == streams
    for i, stream in enumerate(streams):
        tier = OTHER if i % 5 == 0 else GPU
        assert found[stream] == PrefixMatch((tier,) * (i % 9)), stream


def test_longest_prefix_of_streams_sharing_a_prefix_ends_where_each_stops(
    index: BlockIndex,
) -> None:
    # Many holders of one prefix, leaving it at different blocks; holes (a later block held
    # without an earlier one) never count; streams that hold nothing of it are answered too.
    keys = list(range(2001, 2041))
    streams = [StreamId(f"h{i:02d}") for i in range(70)]
    for i, stream in enumerate(streams):
        held = keys[: i % 41] + keys[i % 41 + 1 :: 3] if i % 7 else keys[1:]
        index.apply(stream, 0, 1.0, [store(k, k) for k in held])
    found = index.longest_prefix(keys, reversed(streams))
    assert list(found) == streams[::-1]
    for i, stream in enumerate(streams):
        assert found[stream].num_blocks == (i % 41 if i % 7 else 0), stream


READ_EDGES = [1, 2, 3, 4, 7, 8, 255, 256, 257, 511, 512, 513, 700]
CHUNK_EDGES = [32, 33, 34, 64, 65, 66, 128, 129, 130, 160, 161, 200, 201]
"""Match lengths at the Redis script's chunk edges (see the test below)."""


@pytest.mark.parametrize("num_held", sorted(READ_EDGES + CHUNK_EDGES))
def test_longest_prefix_of_a_long_prompt_ends_at_the_first_miss(
    index: BlockIndex, num_held: int
) -> None:
    # Lengths around the backends' read steps (the Redis script reads 1 block, then 32 at
    # once, more beyond 128: 33, 65, 97, 129, 161, 201 read so far), the last held block off
    # GPU, and the prompt's blocks beyond the first miss held too: they never count.
    keys = list(range(5001, 5701))
    held = [store(k, k) for k in keys[: num_held - 1]] + [store(1, keys[num_held - 1], CPU)]
    held += [store(k, k) for k in keys[num_held + 1 :]]
    index.apply(S, 0, 1.0, held)
    assert tiers(index, keys) == (GPU,) * (num_held - 1) + (CPU,)


def test_a_dropped_or_cleared_stream_leaves_no_match_to_another(index: BlockIndex) -> None:
    # A stream made after a drop (the memory backend reuses the dropped stream's number in
    # its holder bitmaps) matches only what it holds itself.
    seed(index, stream=S)
    seed(index, stream=S_OTHER)
    index.drop(S)
    index.clear(S_OTHER)
    index.apply(S_RANK1, 0, 1.0, [store(1, 101)])
    found = index.longest_prefix([101, 102, 103], [S, S_RANK1, S_OTHER])
    assert found == {S: NO_MATCH, S_RANK1: PrefixMatch((GPU,)), S_OTHER: NO_MATCH}
    seed(index, stream=S, seq=5)
    assert tiers(index, [101, 102, 103], S) == (GPU, GPU, GPU)
    assert tiers(index, [101, 102, 103], S_RANK1) == (GPU,)


def test_the_same_streams_twice_get_answers_of_their_own(index: BlockIndex) -> None:
    seed(index)
    streams = (S, S_OTHER)
    first = index.longest_prefix([101], streams)
    first[S_OTHER] = PrefixMatch((CPU,))
    index.apply(S, 1, 1.0, [remove(1)])
    assert index.longest_prefix([101], streams) == {S: NO_MATCH, S_OTHER: NO_MATCH}
    assert index.longest_prefix([102], [S]) == {S: PrefixMatch((GPU,))}


def test_prefix_holders_are_the_longest_prefix_less_the_streams_matching_nothing(
    index: BlockIndex,
) -> None:
    # Shared, private and off-GPU prefixes, a stream holding only a later block, one never
    # seen: the holders' answer is longest_prefix's without its NO_MATCH entries.
    keys = list(range(3001, 3021))
    streams = [StreamId(f"p{i:02d}", i % 3) for i in range(40)]
    for i, stream in enumerate(streams):
        held = keys[: i % 7] if i % 5 else keys[1:]
        tier = CPU if i % 11 == 0 else GPU
        index.apply(stream, 0, 1.0, [store(k, k, tier) for k in held])
    asked = [*streams[::-1], StreamId("never", 0)]
    found = index.longest_prefix(keys, asked)
    holders = prefix_holders(index, keys, asked)
    assert holders == {s: m for s, m in found.items() if m != NO_MATCH}
    assert holders and len(holders) < len(asked)


def test_holders_come_in_runs_of_one_match_by_index(index: BlockIndex) -> None:
    seed(index, stream=S)
    seed(index, stream=S_OTHER)
    index.apply(S_RANK1, 0, 1.0, [store(1, 101, CPU)])
    asked = [S_OTHER, StreamId("nobody"), S_RANK1, S]
    runs = holders_of(index)([101, 102], asked)
    indices = sorted(i for _, run in runs for i in run)
    assert indices == [0, 2, 3]  # each holder once, the stream holding nothing left out
    assert {asked[i]: match for match, run in runs for i in run} == {
        S: PrefixMatch((GPU, GPU)),
        S_OTHER: PrefixMatch((GPU, GPU)),
        S_RANK1: PrefixMatch((CPU,)),
    }
    assert holders_of(index)([999, 101], asked) == []
    assert holders_of(index)([], asked) == []
    assert holders_of(index)([101], []) == []


def test_longest_prefix_of_no_keys_is_empty_per_stream(index: BlockIndex) -> None:
    seed(index)
    assert index.longest_prefix([], [S, S_OTHER]) == {S: NO_MATCH, S_OTHER: NO_MATCH}
    assert index.longest_prefix([101], []) == {}


def test_resolve_returns_keys_or_none(index: BlockIndex) -> None:
    seed(index)
    assert index.resolve(S, [3, 42, 1]) == [103, None, 101]
    assert index.resolve(S, []) == []
    assert index.resolve(StreamId("nobody"), [1, 2]) == [None, None]


# --- blocks_by_tier -----------------------------------------------------------------------


def test_blocks_by_tier_counts_distinct_blocks(index: BlockIndex) -> None:
    ops = [store(1, 101), store(1, 101), store(2, 102), store(2, 102, CPU), store(3, 103, OTHER)]
    index.apply(S, 0, 1.0, ops)
    stats = index.stats(S)
    assert stats.blocks_by_tier == by_tier(gpu=2, cpu=1, other=1)
    assert stats.num_blocks == 4


@pytest.mark.parametrize(
    ("ops", "expected"),
    [
        ([store(1, 101), store(4, 104), store(2, 102, CPU)], by_tier(gpu=4, cpu=1)),
        ([remove(1), remove(1)], by_tier(gpu=2)),
        ([remove(1, CPU)], by_tier(gpu=3)),
        ([store_by_hash(3, OTHER), store_by_hash(3, OTHER)], by_tier(gpu=3, other=1)),
        ([store_by_hash(3, OTHER), remove(3)], by_tier(gpu=2, other=1)),
        ([remove(3), remove(3, OTHER)], by_tier(gpu=2)),
        ([CLEAR_OP, store(9, 109, CPU)], by_tier(cpu=1)),
        ([store(9, 109, CPU), CLEAR_OP], by_tier()),
    ],
)
def test_blocks_by_tier_stays_consistent(
    index: BlockIndex, ops: list[Op], expected: dict[Tier, int]
) -> None:
    seed(index)
    index.apply(S, 1, 1.0, ops)
    assert index.stats(S).blocks_by_tier == expected


def test_blocks_by_tier_through_a_sequence(index: BlockIndex) -> None:
    steps: list[tuple[list[Op], dict[Tier, int]]] = [
        ([store(1, 101), store(2, 102), store(1, 101, CPU)], by_tier(gpu=2, cpu=1)),
        ([remove(1)], by_tier(gpu=1, cpu=1)),
        ([store_by_hash(1, OTHER), remove(2)], by_tier(cpu=1, other=1)),
        ([remove(1, CPU), remove(1, OTHER)], by_tier()),
        ([store(3, 103, OTHER)], by_tier(other=1)),
    ]
    for seq, (ops, expected) in enumerate(steps):
        index.apply(S, seq, 1.0, ops)
        assert index.stats(S).blocks_by_tier == expected, f"after batch {seq}"
    index.clear(S)
    assert index.stats(S).blocks_by_tier == by_tier()


# --- random batches against a reference model ---------------------------------------------


@dataclass
class _ModelStream:
    key_to_counts: dict[int, dict[Tier, int]] = field(default_factory=dict)
    """Only positive counts; a block with no tier left is absent."""
    hash_to_key: dict[int, int] = field(default_factory=dict)
    watermark: int = -1
    last_ts: float | None = None


class ReferenceIndex:
    """The contract as plain Python, written from ``index.py``'s docstrings.

    One choice the docstrings leave open is modelled on purpose: a REMOVE that leaves its
    block on no tier forgets the engine hash it named (and only that one).
    """

    def __init__(self) -> None:
        self._streams: dict[StreamId, _ModelStream] = {}

    def apply(self, stream: StreamId, seq: int, ts: float, ops: Sequence[Op]) -> ApplyResult:
        state = self._streams.setdefault(stream, _ModelStream())
        if seq <= state.watermark:
            return SKIPPED
        unknown = unresolved = 0
        for kind, tier, engine_hash, key in ops:
            if kind == OpKind.STORE:
                state.hash_to_key[engine_hash] = key
                _count(state, key, Tier(tier), +1)
            elif kind == OpKind.STORE_BY_HASH:
                unresolved += not _store_by_hash(state, engine_hash, Tier(tier))
            elif kind == OpKind.REMOVE:
                unknown += not _remove(state, engine_hash, Tier(tier))
            else:
                state.key_to_counts.clear()
                state.hash_to_key.clear()
        state.watermark, state.last_ts = seq, ts
        return ApplyResult(True, unknown, unresolved)

    def clear(self, stream: StreamId) -> None:
        if stream in self._streams:
            self._streams[stream] = _ModelStream()

    def drop(self, stream: StreamId) -> None:
        self._streams.pop(stream, None)

    def streams(self) -> list[StreamId]:
        return sorted(self._streams)

    def resolve(self, stream: StreamId, engine_hashes: Sequence[int]) -> list[int | None]:
        state = self._streams.get(stream, _ModelStream())
        return [state.hash_to_key.get(h) for h in engine_hashes]

    def longest_prefix(
        self, keys: Sequence[int], streams: Iterable[StreamId]
    ) -> dict[StreamId, PrefixMatch]:
        return {s: _prefix(self._streams.get(s, _ModelStream()), keys) for s in streams}

    def stats(self, stream: StreamId) -> StreamStats:
        state = self._streams.get(stream, _ModelStream())
        counts = state.key_to_counts.values()
        blocks = {tier: sum(tier in c for c in counts) for tier in Tier}
        return StreamStats(stream, state.watermark, state.last_ts, blocks)


def _count(state: _ModelStream, key: int, tier: Tier, delta: int) -> None:
    counts = state.key_to_counts.setdefault(key, {})
    counts[tier] = counts.get(tier, 0) + delta
    if counts[tier] == 0:
        del counts[tier]
    if not counts:
        del state.key_to_counts[key]


def _store_by_hash(state: _ModelStream, engine_hash: int, tier: Tier) -> bool:
    key = state.hash_to_key.get(engine_hash)
    if key is not None:
        _count(state, key, tier, +1)
    return key is not None


def _remove(state: _ModelStream, engine_hash: int, tier: Tier) -> bool:
    key = state.hash_to_key.get(engine_hash)
    if key is None or tier not in state.key_to_counts.get(key, {}):
        return False
    _count(state, key, tier, -1)
    if key not in state.key_to_counts:
        del state.hash_to_key[engine_hash]
    return True


def _prefix(state: _ModelStream, keys: Sequence[int]) -> PrefixMatch:
    found: list[Tier] = []
    for key in keys:
        counts = state.key_to_counts.get(key)
        if counts is None:
            break
        found.append(min(counts))
    return PrefixMatch(tuple(found))


@dataclass(frozen=True)
class Batch:
    stream: StreamId
    seq: int
    ts: float
    ops: tuple[Op, ...]


@dataclass(frozen=True)
class Clear:
    stream: StreamId


@dataclass(frozen=True)
class Drop:
    stream: StreamId


Step = Batch | Clear | Drop

STREAMS = (S, S_RANK1, S_OTHER)
ENGINE_HASHES = (1, 2, 2**63, MAX_U64)
KEYS = (101, 102, 2**63 + 7, MAX_U64 - 1)
QUERIES = (KEYS, KEYS[::-1], *((k,) for k in KEYS))
_KINDS = (OpKind.STORE,) * 3 + (OpKind.STORE_BY_HASH,) * 2 + (OpKind.REMOVE,) * 3
_KINDS_WITH_CLEAR = (*_KINDS, OpKind.CLEAR)


@st.composite
def ops(draw: st.DrawFn) -> Op:
    kind = draw(st.sampled_from(_KINDS_WITH_CLEAR))
    if kind == OpKind.CLEAR:
        return CLEAR_OP
    tier = draw(st.sampled_from(Tier))
    engine_hash = draw(st.sampled_from(ENGINE_HASHES))
    key = draw(st.sampled_from(KEYS)) if kind == OpKind.STORE else 0
    return (kind, tier, engine_hash, key)


@st.composite
def steps(draw: st.DrawFn) -> Step:
    stream = draw(st.sampled_from(STREAMS))
    what = draw(st.sampled_from(("batch",) * 8 + ("clear", "drop")))
    if what == "clear":
        return Clear(stream)
    if what == "drop":
        return Drop(stream)
    seq = draw(st.integers(0, 15))
    ts = draw(st.floats(0.0, 2e9, allow_nan=False))
    return Batch(stream, seq, ts, tuple(draw(st.lists(ops(), max_size=8))))


def _run(step: Step, index: BlockIndex, model: ReferenceIndex) -> None:
    if isinstance(step, Batch):
        got = index.apply(step.stream, step.seq, step.ts, step.ops)
        assert got == model.apply(step.stream, step.seq, step.ts, step.ops)
    elif isinstance(step, Clear):
        index.clear(step.stream)
        model.clear(step.stream)
    else:
        index.drop(step.stream)
        model.drop(step.stream)


def _assert_same(index: BlockIndex, model: ReferenceIndex) -> None:
    assert index.streams() == model.streams()
    for stream in STREAMS:
        assert index.stats(stream) == model.stats(stream)
        assert index.resolve(stream, ENGINE_HASHES) == model.resolve(stream, ENGINE_HASHES)
    for keys in QUERIES:
        found = model.longest_prefix(keys, STREAMS)
        assert index.longest_prefix(keys, STREAMS) == found
        assert prefix_holders(index, keys, STREAMS) == {s: m for s, m in found.items() if m.tiers}


@settings(
    max_examples=50,
    deadline=None,
    # make_index is function-scoped, but every make_index() call starts from nothing.
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(script=st.lists(steps(), max_size=25))
def test_random_batches_match_reference_model(make_index: IndexFactory, script: list[Step]) -> None:
    index = make_index()
    model = ReferenceIndex()
    for step in script:
        _run(step, index, model)
        _assert_same(index, model)
