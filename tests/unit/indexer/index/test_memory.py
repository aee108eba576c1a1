"""kvindex.indexer.index.memory: what only the in-process backend does (the contract suite covers
the rest). ``longest_prefix`` reads no counts while a stream holds blocks on GPU only; these tests
move streams in and out of that case and check the answer never changes. A lookup walks the
block → holders map, not the streams: tests count its reads and check that it forgets what no
stream holds. ``holders`` answers the holders alone, by index in the streams asked, in runs
of one match."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest

from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.index import memory
from kvindex.indexer.index.memory import IndexLock, MemoryIndex
from kvindex.indexer.index.protocol import (
    NO_MATCH,
    HolderLookup,
    OnGpu,
    Op,
    OpKind,
    PrefixMatch,
    gpu_count,
)
from tests.oracles.tables import PyTables, python_index

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


class _CountingDict(dict[int, int]):
    """A holders map that counts the lookups' reads."""

    num_gets = 0

    def get(self, key: int, default: Any = None) -> Any:
        self.num_gets += 1
        return super().get(key, default)


def _python(index: MemoryIndex) -> PyTables:
    tables = index._tables
    assert isinstance(tables, PyTables)
    return tables


def _counting(index: MemoryIndex) -> _CountingDict:
    holders = _CountingDict()
    _python(index).holders = holders  # before any stream: each stream shares the map
    return holders


def test_lookup_reads_the_matched_prefix_not_the_streams() -> None:
    index = python_index()  # the compiled walk is the same (tests/contract)
    holders = _counting(index)
    streams = [StreamId(f"r{i}") for i in range(500)]
    for i, stream in enumerate(streams):  # each its own block, two hold the prompt's start
        ops = [store(1, 10_000 + i)] + ([store(2, 101), store(3, 102)] if i < 2 else [])
        index.apply(stream, 0, 1.0, ops)
    holders.num_gets = 0
    found = index.longest_prefix(KEYS, streams)
    assert holders.num_gets == 3  # 101 and 102 held, 103 missed: no read per stream
    assert {s: m.num_blocks for s, m in found.items() if m.num_blocks} == {
        streams[0]: 2,
        streams[1]: 2,
    }
    holders.num_gets = 0
    assert index.longest_prefix([999, *KEYS], streams)[streams[0]] == NO_MATCH
    assert holders.num_gets == 1


def test_holders_map_forgets_what_no_stream_holds() -> None:
    index = python_index()
    other = StreamId("r2")
    index.apply(S, 0, 1.0, [store(1, 101), store(2, 102), store(2, 102, CPU)])
    index.apply(other, 0, 1.0, [store(1, 101), store(3, 103)])
    index.apply(S, 1, 1.0, [remove(2), remove(2, CPU)])
    index.apply(other, 1, 1.0, [(OpKind.CLEAR, GPU, 0, 0)])
    assert _python(index).holders == {101: ~index._streams[S].number}
    index.drop(S)
    assert _python(index).holders == {}


def test_stream_numbers_are_reused_after_drops() -> None:
    index = python_index()
    for round_ in range(3):
        streams = [StreamId(f"r{round_}-{i}") for i in range(50)]
        for stream in streams:
            index.apply(stream, 0, 1.0, [store(1, 101)])
        assert _python(index).holders[101] == (1 << 50) - 1  # numbers 0..49, whatever the round
        for stream in streams:
            index.drop(stream)


def test_holders_answer_the_holders_alone_in_runs_of_one_match() -> None:
    for compiled in (True, False):
        index = MemoryIndex() if compiled else python_index()
        assert isinstance(index, HolderLookup)
        streams = [StreamId(f"r{i}") for i in range(300)]
        for i, stream in enumerate(streams):  # every 3rd holds 2 blocks, one of them on CPU
            ops = [store(1, 10_000 + i)]
            if i % 3 == 0:
                ops += [store(2, 101), store(3, 102, CPU if i == 150 else GPU)]
            index.apply(stream, 0, 1.0, ops)
        asked = tuple(streams[::-1])
        runs = index.holders(KEYS, asked)
        on_gpu = PrefixMatch((GPU, GPU))
        assert [(m, sorted(asked[i] for i in run)) for m, run in runs] == [
            (on_gpu, sorted(s for i, s in enumerate(streams) if i % 3 == 0 and i != 150)),
            (PrefixMatch((GPU, CPU)), [streams[150]]),
        ]
        assert runs[0][0] is not NO_MATCH and len(runs[0][1]) == 99  # one answer shared
        assert index.holders([999, *KEYS], asked) == []
        assert index.holders(KEYS, asked[:1]) == []  # r299 holds nothing of the prompt
        found = index.longest_prefix(KEYS, asked)
        assert {asked[i]: m for m, run in runs for i in run} == {
            s: m for s, m in found.items() if m.tiers
        }


def test_an_equal_tuple_of_streams_reuses_the_prepared_lookup_and_is_kept() -> None:
    index = MemoryIndex()
    streams = [StreamId(f"r{i}") for i in range(4)]
    for i, stream in enumerate(streams):
        index.apply(stream, 0, 1.0, [store(1, 101)] + ([store(2, 102)] if i == 2 else []))
    first = tuple(streams)
    runs = index.holders(KEYS, first)
    prepared = index._asked
    again = tuple(StreamId(f"r{i}") for i in range(4))  # equal, not the same objects
    assert index.holders(KEYS, again) == runs
    assert index._asked is not None and index._asked.streams is again  # next time: an `is`
    assert prepared is not None and index._asked.index_of == prepared.index_of
    assert index.longest_prefix(KEYS, again) == index.longest_prefix(KEYS, first)
    index.drop(streams[0])  # the numbering changes: prepared again
    after = {m.tiers: sorted(run) for m, run in index.holders(KEYS, again[1:])}
    assert after == {(GPU,): [0, 2], (GPU, GPU): [1]}


def test_holders_read_the_matched_prefix_not_the_streams() -> None:
    index = python_index()
    holders = _counting(index)
    streams = [StreamId(f"r{i}") for i in range(500)]
    for i, stream in enumerate(streams):
        index.apply(stream, 0, 1.0, [store(1, 10_000 + i)] + ([store(2, 101)] if i == 7 else []))
    holders.num_gets = 0
    assert index.holders(KEYS, streams) == [(PrefixMatch((GPU,)), [7])]
    assert holders.num_gets == 1  # 101 alone: one holder, its own map walks on


# --- the lock ------------------------------------------------------------------------------


def test_a_hand_over_lets_the_waiting_thread_in_before_the_holder_goes_on() -> None:
    lock = IndexLock()
    order: list[str] = []

    def waiter() -> None:
        with lock:
            order.append("waiter")

    with lock:
        assert not lock.hand_over()  # nobody waits: it keeps the lock
        thread = threading.Thread(target=waiter)
        thread.start()
        deadline = time.monotonic() + 5
        while lock.num_waiting == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert lock.num_waiting == 1
        assert lock.hand_over()
        order.append("holder")  # taken back only after the waiter's hold
    thread.join(5)
    assert order == ["waiter", "holder"] and lock.num_waiting == 0


def test_a_write_hands_the_lock_over_every_hold_blocks_ops_and_rereads_its_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between two pieces of a write another thread may clear or drop the stream: the
    rest is applied to the stream as it is then, never to a stale number."""
    monkeypatch.setattr(memory, "HOLD_BLOCKS", 2)
    index = python_index()
    thief = StreamId("thief")
    handed: list[int] = []

    class _Turns(IndexLock):
        def hand_over(self) -> bool:
            handed.append(len(handed))
            if len(handed) == 1:  # another thread's turn, taken here in its place
                self._lock.release()
                index.drop(S)
                index.apply(thief, 0, 0.0, [store(900, 9000)])  # it takes S's old number
                self._lock.acquire()
            return True

    index._lock = _Turns()
    batches = [
        (seq, float(seq), [store(seq, 100 + seq), store(seq + 50, 200 + seq)]) for seq in range(3)
    ]
    results = index.apply_many(S, batches)
    assert len(handed) == 2 and all(r.applied for r in results)
    stats = index.stats(S)
    assert (stats.watermark, stats.num_blocks) == (2, 4)  # batch 0 dropped with the stream
    assert index.resolve(S, [0, 1, 2]) == [None, 101, 102]
    assert index.stats(thief).num_blocks == 1 and index.resolve(thief, [900, 1]) == [9000, None]


def test_native_pieces_cover_the_batches_in_order_and_hold_about_hold_blocks() -> None:
    sizes = [700, 700, 700, 5000, 10, 10, 2048, 1]

    class _Sized:
        def __init__(self, num_blocks: int) -> None:
            self.num_blocks = num_blocks

    batches: list[Any] = [_Sized(n) for n in sizes]
    pieces = memory._pieces(batches)
    assert [b for piece in pieces for b in piece] == batches
    assert [[b.num_blocks for b in p] for p in pieces] == [
        [700, 700, 700], [5000], [10, 10, 2048], [1],
    ]  # fmt: skip
    totals = [0] * 9 + [-1]
    memory._add_counts(totals, (1, 0, 0, 5, 0, 0, 0, 0, 0, 16))
    memory._add_counts(totals, (2, 1, 0, 0, 3, 0, 0, 0, 0, -1))
    assert totals == [3, 1, 0, 5, 3, 0, 0, 0, 0, 16]


def test_all_gpu_matches_are_counted_by_length_and_reused_within_a_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    index = MemoryIndex()
    index.apply(S, 0, 1.0, [store(1, 101), store(2, 102)])
    off_gpu = StreamId("r2")
    index.apply(off_gpu, 0, 1.0, [store(1, 101), store(2, 102, CPU), store(3, 103)])
    gpu_run = index.longest_prefix(KEYS[:2], [S])[S]
    assert type(gpu_run.tiers) is OnGpu and gpu_run == PrefixMatch((GPU, GPU))
    assert index.longest_prefix(KEYS[:2], [S])[S] is gpu_run  # one object per length
    mixed = index.longest_prefix(KEYS, [off_gpu])[off_gpu].tiers
    assert type(mixed) is tuple and gpu_count(mixed) == 2 == gpu_count(gpu_run.tiers)
    monkeypatch.setattr(memory, "_GPU_MATCHES_BLOCKS", 2)
    assert index.longest_prefix(KEYS[:1], [S])[S] == PrefixMatch((GPU,))  # past the bound
    assert index.longest_prefix(KEYS[:2], [S])[S] is not gpu_run  # dropped, made again


def test_compiled_runs_equal_the_reference() -> None:
    # Tables past the size from which a lookup prefetches: chains sharing prefixes on many
    # streams, some blocks off GPU, every stream or a part asked, prompts stopping anywhere.
    rng = random.Random(7)
    index, python = MemoryIndex(), python_index()
    streams = [StreamId(f"r{i}") for i in range(40)]
    shared = [[rng.getrandbits(64) for _ in range(rng.randint(0, 40))] for _ in range(6)]
    prompts: list[list[int]] = []
    for seq in range(60):
        chain = shared[seq % 6] + [rng.getrandbits(64) for _ in range(rng.randint(600, 1800))]
        tier = CPU if seq % 9 == 0 else GPU
        ops = [store(rng.getrandbits(64), k, tier if i % 5 else GPU) for i, k in enumerate(chain)]
        for each in (index, python):
            each.apply(streams[seq % 40], seq, 1.0, ops)
        prompts.append([*chain[: rng.randint(1, len(chain))], rng.getrandbits(64)])
    prompts += [[rng.getrandbits(64), *chain] for chain in prompts[:3]]
    prompts += [[], shared[0]]
    for asked in (tuple(streams), tuple(streams[::3]), tuple(streams[5:6])):
        for keys in prompts:
            runs = index.holders(keys, asked)
            assert runs == python.holders(keys, asked)
            assert runs == index._held_reference(keys, index._asked_for(asked))
    with pytest.raises(OverflowError):
        index.holders([-1, *prompts[0]], streams)
