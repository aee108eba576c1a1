"""kvindex.indexer.native: the compiled hot loops agree with the pure-Python reference.

The install builds the extension (setup.py), so these tests require it: a missing build
fails here rather than leaving every other test on the fallback unnoticed. Random inputs
(hypothesis) judge agreement: block keys over random tokens and block sizes, and random
batches of index operations on a few streams, with clears, drops and lookups between them,
random events translated into index operations with and without the compiled loops, random
payloads decoded with token ids packed and the general way, and engine-hash lists checked
compiled and in Python.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.indexer import native
from kvindex.indexer.domain.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    StreamId,
    Tier,
)
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.domain.keys import BlockKeyError, block_keys, chain_keys, tokens_to_bytes
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import Op, OpKind
from kvindex.indexer.ingest import wire
from kvindex.indexer.ingest.ingestor import Ingestor
from tests.oracles import translation
from tests.oracles.tables import python_index
from tests.oracles.translation import python_translation

U64 = st.integers(0, 2**64 - 1)


def test_the_install_built_the_extension() -> None:
    assert MemoryIndex().compiled
    assert not python_index().compiled


def _python_chain(parent: int, token_bytes: bytes, block_size: int) -> list[int]:
    # Extra keys of None per block take the pure-Python loop; the hashed bytes are the same.
    return chain_keys(parent, token_bytes, block_size, [None] * (len(token_bytes) // 4))


@settings(max_examples=200, deadline=None)
@given(U64, st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(1, 40))
def test_compiled_chain_agrees_with_python(parent: int, tokens: list[int], size: int) -> None:
    token_bytes = tokens_to_bytes(tokens)
    expected = _python_chain(parent, token_bytes, size)
    assert native.chain(parent, token_bytes, size) == expected
    assert native.chain_tokens(parent, tokens, size) == expected
    assert native.chain_tokens(parent, tuple(tokens), size) == expected


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 2**32 - 1) | st.integers(-5, -1) | st.just(2**32), max_size=50),
    st.booleans(),
)
def test_pack_tokens_equal_the_python_packing(tokens: list[int], as_tuple: bool) -> None:
    """The same bytes, or the same refusal, for a list or a tuple."""
    given_ids: Sequence[int] = tuple(tokens) if as_tuple else tokens

    def packed(pack: Callable[[Sequence[int]], bytes]) -> bytes | str:
        try:
            return pack(given_ids)
        except (OverflowError, TypeError):
            return "refused"

    assert packed(native.pack_tokens) == packed(translation.pack_tokens)


@pytest.mark.parametrize("bad", [[-1], [2**32], ["7"], [1.5]])
def test_block_keys_rejects_bad_token_ids(bad: list[object]) -> None:
    with pytest.raises(BlockKeyError):
        block_keys("m", [1, 2, 3, *bad], 4)  # type: ignore[list-item]


def test_only_whole_blocks_are_read() -> None:
    assert block_keys("m", [1, 2, 3, 4, -1], 4) == block_keys("m", [1, 2, 3, 4], 4)


# --- the memory store's tables -------------------------------------------------------------

STREAMS = [StreamId(f"r{i}") for i in range(4)]
_op = st.tuples(
    st.sampled_from([OpKind.STORE, OpKind.STORE, OpKind.STORE_BY_HASH, OpKind.REMOVE]),
    st.sampled_from(list(Tier)),
    st.integers(0, 12),  # engine hashes: few, so they collide and repeat (0 included)
    st.integers(0, 12),  # keys likewise
).map(lambda op: op if op[0] == OpKind.STORE else (op[0], op[1], op[2], 0))
Step = tuple[str, StreamId, list[Op]]
_step: st.SearchStrategy[Step] = st.one_of(
    st.tuples(st.just("apply"), st.sampled_from(STREAMS), st.lists(_op, max_size=12)),
    st.tuples(st.just("clear_op"), st.sampled_from(STREAMS), st.just([])),
    st.tuples(st.just("clear"), st.sampled_from(STREAMS), st.just([])),
    st.tuples(st.just("drop"), st.sampled_from(STREAMS), st.just([])),
)


def _run(index: MemoryIndex, steps: list[Step]) -> list[object]:
    """Every step's observable result, then lookups of every key run."""
    seen: list[object] = []
    for seq, (what, stream, ops) in enumerate(steps):
        if what == "apply":
            seen.append(index.apply(stream, seq, float(seq), ops))
        elif what == "clear_op":
            seen.append(index.apply(stream, seq, 1.0, [(OpKind.CLEAR, Tier.GPU, 0, 0)]))
        elif what == "clear":
            index.clear(stream)
        else:
            index.drop(stream)
        seen.append([index.stats(s) for s in STREAMS])
        seen.append([index.resolve(s, list(range(13))) for s in STREAMS])
    for start in range(13):
        keys = [(start + i) % 13 for i in range(6)]
        seen.append(index.longest_prefix(keys, STREAMS))
        seen.append(index.holders(keys, STREAMS))  # the same runs, in the same order
    return seen


@settings(max_examples=300, deadline=None)
@given(st.lists(_step, max_size=25))
def test_compiled_tables_agree_with_python(steps: list[Step]) -> None:
    assert _run(MemoryIndex(), steps) == _run(python_index(), steps)


def test_tables_grow_and_shrink_back_exactly() -> None:
    # Enough blocks for several resizes and many backward-shift deletions.
    index, python = MemoryIndex(), python_index()
    stores = [(OpKind.STORE, Tier.GPU, h, h * 7919 % 100_003) for h in range(20_000)]
    removes = [(OpKind.REMOVE, Tier.GPU, h, 0) for h in range(0, 20_000, 3)]
    for each in (index, python):
        each.apply(STREAMS[0], 0, 1.0, stores)
        each.apply(STREAMS[1], 0, 1.0, stores[::2])
        each.apply(STREAMS[0], 1, 1.0, removes)
    keys = [key for _, _, _, key in stores]
    assert index.stats(STREAMS[0]) == python.stats(STREAMS[0])
    assert index.resolve(STREAMS[0], list(range(20_000))) == python.resolve(
        STREAMS[0], list(range(20_000))
    )
    for start in range(0, 20_000, 997):
        assert index.longest_prefix(keys[start:], STREAMS) == python.longest_prefix(
            keys[start:], STREAMS
        )


def test_tables_agree_through_churn_of_random_hashes() -> None:
    # Random 64-bit hashes and keys (homes anywhere, runs wrapping past the array's end),
    # stored and removed in turns while the tables grow: every lookup and count as in dicts.
    rng = random.Random(14)
    index, python = MemoryIndex(), python_index()
    held: list[int] = []
    for seq in range(40):
        ops: list[Op] = []
        for _ in range(1_500):
            if held and rng.random() < 0.4:
                ops.append((OpKind.REMOVE, Tier.GPU, held.pop(rng.randrange(len(held))), 0))
            else:
                engine_hash = rng.getrandbits(64)
                held.append(engine_hash)
                ops.append((OpKind.STORE, rng.choice(list(Tier)), engine_hash, rng.getrandbits(64)))
        for each in (index, python):
            assert each.apply(STREAMS[seq % 2], seq, 1.0, ops) is not None
    probes = held + [rng.getrandbits(64) for _ in range(2_000)]
    for stream in STREAMS[:2]:
        assert index.stats(stream) == python.stats(stream)
        assert index.resolve(stream, probes) == python.resolve(stream, probes)


# --- event → op translation ----------------------------------------------------------------

_stored = st.builds(
    lambda n, size, parent, tier, bad: BlockStored(
        tuple(range(1000 * n, 1000 * n + n)),
        parent,
        [(7 * i) % 50_000 for i in range(n * size)] + ([-1] if bad else []),
        size,
        tier,
    ),
    st.integers(1, 6),
    st.integers(1, 8),
    st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    st.sampled_from(list(Tier)),
    st.booleans(),
)
_event = st.one_of(
    _stored,
    st.builds(
        BlockRemoved, st.lists(st.integers(0, 10_000), max_size=5), st.sampled_from(list(Tier))
    ),
    st.just(AllBlocksCleared()),
)


def _translate(events: list[Event], *, compiled: bool) -> tuple[list[Op], StreamReport]:
    report = StreamReport()
    batch = EventBatch(0, 1.0, 0, events)
    if compiled:
        return Ingestor(MemoryIndex()).translate(STREAMS[0], "m", batch, report), report
    with python_translation():
        return Ingestor(MemoryIndex()).translate(STREAMS[0], "m", batch, report), report


@settings(max_examples=200, deadline=None)
@given(st.lists(_event, max_size=8))
def test_compiled_translation_agrees_with_python(events: list[Event]) -> None:
    assert _translate(events, compiled=True) == _translate(events, compiled=False)


# --- decoding with token ids packed --------------------------------------------------------

_token = st.one_of(
    st.integers(0, 2**32 - 1), st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, 127, 128])
)
_wire_tokens = st.one_of(
    st.lists(_token, max_size=40),
    st.lists(st.integers(0, 2**32 - 1), min_size=15, max_size=40),  # array16 past 15
    st.lists(st.one_of(st.integers(0, 9), st.floats(), st.booleans(), st.text()), max_size=4),
)


def _stored_map(tokens: list[object], size: int, medium: str | None) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": [5, b"\x01" * 32], "parent_block_hash": None,
            "token_ids": tokens, "block_size": size, "lora_id": None, "medium": medium}  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(_wire_tokens, st.integers(0, 16), st.sampled_from([None, "GPU", "cpu"]))),
    st.booleans(),
)
def test_packed_decoding_agrees_with_the_general_one(
    stores: list[tuple[list[object], int, str | None]], as_arrays: bool
) -> None:
    # Events as vLLM sends them (maps or arrays), token ids of every kind: in range, out of
    # range, not ints. Wherever the fast path decodes a batch, it decodes it as the general
    # one does (packed token ids equal to the lists); elsewhere it leaves it to that one.
    events: list[object] = [
        _stored_map(tokens, size, medium) if not as_arrays
        else ["BlockStored", [5, b"\x01" * 32], None, tokens, size, None, medium]
        for tokens, size, medium in stores
    ]  # fmt: skip
    events.append({"type": "AllBlocksCleared"} if not as_arrays else ["AllBlocksCleared"])
    payload = msgspec.msgpack.encode([1.5, events, 0])
    general = wire._decode_general(payload, 3)
    assert wire.decode_payload(payload, 3) == general
    packed = wire._decode_packed(payload, 3)
    in_range = all(type(t) is int and 0 <= t < 2**32 for tokens, _, _ in stores for t in tokens)
    assert (packed is not None) == (in_range and general.num_bad_events == 0)
    if packed is not None:
        assert packed == general
        for event, want in zip(packed.events, general.events, strict=True):
            if isinstance(event, BlockStored):
                assert isinstance(want, BlockStored)
                assert type(event.token_ids) is native.PackedTokens
                assert event.token_ids.packed == tokens_to_bytes(want.token_ids)


def test_packed_tokens_behave_as_the_list() -> None:
    listed = [0, 1, 127, 128, 255, 256, 65_535, 65_536, 2**31, 2**32 - 1]
    tokens = native.packed_tokens(msgspec.msgpack.encode(listed))
    assert tokens is not None
    assert tokens == listed and listed == tokens and tokens != tuple(listed)
    assert list(tokens) == tokens.tolist() == listed and len(tokens) == len(listed)
    assert tokens[0] == 0 and tokens[-1] == 2**32 - 1 and tokens[2:5] == listed[2:5]
    assert tokens[::-3] == listed[::-3] and 128 in tokens and 3 not in tokens
    assert isinstance(tokens, Sequence) and repr(tokens) == f"PackedTokens({listed!r})"
    with pytest.raises(IndexError):
        tokens[len(listed)]
    for bad in (b"", b"\x91", b"\x92\x01", b"\x91\xff", b"\x91\xcf" + b"\x01" * 8, b"\xc0"):
        assert native.packed_tokens(bad) is None
    assert native.packed_tokens(msgspec.msgpack.encode([1, 2]) + b"\x00") is None
    many = list(range(70_000))  # an array32 head
    assert native.packed_tokens(msgspec.msgpack.encode(many)) == many


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            U64, st.integers(-(2**63), -1), st.binary(max_size=40), st.booleans(), st.floats()
        ),
        max_size=12,
    )
)
def test_compiled_hash_fast_path_agrees_with_python(values: list[object]) -> None:
    # Where the compiled check takes a list as already u64, the Python path gives the same
    # tuple; anything else (negative, bytes, not an int) it leaves to the Python path.
    unsigned = native.unsigned_hashes(values)
    plain = all(type(v) is int and 0 <= v < 2**64 for v in values)
    assert (unsigned is not None) == plain
    if unsigned is not None:
        assert wire._general_hashes(values) == unsigned  # type: ignore[arg-type]
    assert native.unsigned_hashes(tuple(values)) is None
