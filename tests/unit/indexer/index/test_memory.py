"""kvindex.indexer.index.memory: what only the in-process backend does (the contract suite covers
the
rest). ``longest_prefix`` reads no counts while a stream holds blocks on GPU only; these tests
move streams in and out of that case and check the answer never changes."""

from __future__ import annotations

from kvindex.indexer.events import StreamId, Tier
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import NO_MATCH, Op, OpKind, PrefixMatch

S = StreamId("r1")
GPU, CPU, OTHER = Tier.GPU, Tier.CPU, Tier.OTHER
KEYS = [101, 102, 103, 104]


def store(engine_hash: int, key: int, tier: Tier = GPU) -> Op:
    return (OpKind.STORE, tier, engine_hash, key)


def remove(engine_hash: int, tier: Tier = GPU) -> Op:
    return (OpKind.REMOVE, tier, engine_hash, 0)


def prefix(index: MemoryIndex, keys: list[int] = KEYS) -> tuple[Tier, ...]:
    return index.longest_prefix(keys, [S])[S].tiers


def test_gpu_only_stream_matches_up_to_the_first_miss() -> None:
    index = MemoryIndex()
    index.apply(S, 0, 1.0, [store(1, 101), store(2, 102), store(4, 104)])
    assert prefix(index) == (GPU, GPU)
    assert prefix(index, [999, *KEYS]) == ()
    assert index.longest_prefix([], [S]) == {S: NO_MATCH}


def test_a_block_off_gpu_is_reported_with_its_tier() -> None:
    index = MemoryIndex()
    index.apply(S, 0, 1.0, [store(1, 101), store(2, 102, CPU), store(3, 103, OTHER)])
    assert prefix(index) == (GPU, CPU, OTHER)


def test_gpu_wins_over_a_copy_on_another_tier() -> None:
    index = MemoryIndex()
    index.apply(S, 0, 1.0, [store(1, 101), store(1, 101, CPU), store(2, 102, CPU)])
    assert prefix(index) == (GPU, CPU)


def test_stream_back_on_gpu_only_after_its_cpu_copies_go() -> None:
    index = MemoryIndex()
    index.apply(S, 0, 1.0, [store(1, 101), store(2, 102), store(2, 102, CPU)])
    index.apply(S, 1, 1.0, [remove(2, CPU)])
    assert prefix(index) == (GPU, GPU)
    index.apply(S, 2, 1.0, [remove(2)])
    assert prefix(index) == (GPU,)


def test_block_moved_from_gpu_to_cpu_stops_being_gpu() -> None:
    index = MemoryIndex()
    index.apply(S, 0, 1.0, [store(1, 101), store(2, 102)])
    index.apply(S, 1, 1.0, [store(2, 102, CPU), remove(2)])
    assert index.longest_prefix(KEYS, [S]) == {S: PrefixMatch((GPU, CPU))}
