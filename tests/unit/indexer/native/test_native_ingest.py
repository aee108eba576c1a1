"""The compiled ingest path (live batches decoded to ``native.NativeBatch`` and applied by
``native.Tables.ingest``) against the Python path it stands in for.

Two pipelines over compiled memory indexes get the same live messages, one with
``native_ingest`` (the default) and one without, whose ingestor translates with the Python
oracles (``tests.oracles.translation``, the key cache included): every report they hand the registry
(counters, block size, last seq and timestamp) and everything the two indexes hold
(stats, engine hash → key, best tier of every key) must be the same. Inputs: the captured
vLLM frames (``tests/fixtures``), hypothesis-fuzzed frames (valid and corrupt, with gaps,
duplicates and seqs going back), and random chains of stores, removals and clears over a
small hash pool with a key cache small enough that parents are looked up in the index
and come back as orphans.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest.mock import patch

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvindex.indexer import native
from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.domain.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    StreamId,
    Tier,
)
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.domain.keys import block_keys, chain_keys, tokens_to_bytes
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index import memory
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.ingest.ingestor import Ingestor
from kvindex.indexer.ingest.pipeline import Pipeline
from kvindex.indexer.ingest.wire import (
    decode_live,
    decode_live_native,
    encode_batch,
    encode_live,
    encode_seq,
)
from tests.oracles.key_cache import KeyCache as PyKeyCache
from tests.oracles.tables import python_index
from tests.oracles.translation import python_translation
from tests.support.frame_fuzz import Message, messages

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"
FAST = settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MODEL = "m"
POOL = 10
"""Engine hashes of the random chains: few, so stores chain, remove and overwrite."""


@dataclass
class Rig:
    pipeline: Pipeline
    index: MemoryIndex
    reports: list[dict[str, object]]
    stream: StreamId

    @classmethod
    def of(cls, replica: str, *, native_ingest: bool, cache_size: int = 65_536) -> Rig:
        spec = ReplicaSpec(replica, MODEL)
        registry = Registry((spec,))
        index = MemoryIndex()
        settings = IndexerSettings(replicas=(spec,), key_cache_size=cache_size)
        pipeline = Pipeline(settings, index, registry, native_ingest=native_ingest)
        stream = StreamId(replica)
        pipeline.track(stream, spec)
        reports: list[dict[str, object]] = []
        record = registry.record

        def recorded(stream: StreamId, report: StreamReport) -> None:
            # NaN (a payload's ts may be one) never equals itself: compared by its repr.
            fields = dataclasses.asdict(report)
            reports.append({k: _nan_safe(v) for k, v in fields.items()})
            record(stream, report)

        registry.record = recorded  # type: ignore[method-assign]
        return cls(pipeline, index, reports, stream)

    def blocks(self, hashes: list[int]) -> tuple[object, ...]:
        stats = self.index.stats(self.stream)
        keys = self.index.resolve(self.stream, hashes)
        held = [k for k in keys if k is not None]
        tiers = [self.index.longest_prefix([k], [self.stream])[self.stream].tiers for k in held]
        return stats.watermark, repr(stats.last_event_ts), stats.blocks_by_tier, keys, tiers


def _nan_safe(value: object) -> object:
    return repr(value) if isinstance(value, float) and math.isnan(value) else value


@contextmanager
def native_runs() -> Iterator[list[int]]:
    """Counts the batches the compiled path applied (to check a test reached it)."""
    counted: list[int] = []
    real = Ingestor._native_run

    def run(
        self: Ingestor, stream: StreamId, model: str, batches: list[Any], report: StreamReport
    ) -> None:
        counted.append(len(batches))
        real(self, stream, model, batches, report)

    with patch.object(Ingestor, "_native_run", run):
        yield counted


def feed_both(
    deliveries: list[list[list[bytes]]], hashes: list[int], *, cache_size: int = 65_536
) -> int:
    """The deliveries (each one ``handle_frames`` call) through both pipelines; asserts
    they agree; returns how many batches took the compiled path."""
    fast = Rig.of("r1", native_ingest=True, cache_size=cache_size)
    slow = Rig.of("r1", native_ingest=False, cache_size=cache_size)
    with native_runs() as counted:
        for messages_ in deliveries:
            fast.pipeline.handle_frames(messages_, fast.stream)
    num_native = sum(counted)
    with native_runs() as counted, python_translation():
        for messages_ in deliveries:
            slow.pipeline.handle_frames(messages_, slow.stream)
    assert not counted, "the Python pipeline took the compiled path"
    assert fast.reports == slow.reports
    assert fast.pipeline.counters == slow.pipeline.counters
    assert fast.blocks(hashes) == slow.blocks(hashes)
    return num_native


def test_the_install_built_the_compiled_ingest_path() -> None:
    assert MemoryIndex().native_ingest
    assert not python_index().native_ingest
    assert Ingestor(MemoryIndex()).native and not Ingestor(python_index()).native


# --- the captured frames ------------------------------------------------------------------


def _captured(name: str) -> list[list[bytes]]:
    vectors = json.loads((FIXTURES / name).read_text())["vectors"]
    return [
        [base64.b64decode(f) for f in v["frames_b64"]] for v in vectors if v["channel"] == "pub"
    ]


def _captured_hashes(frames: list[list[bytes]]) -> list[int]:
    found: set[int] = set()
    for message in frames:
        for event in decode_live(message).batch.events:
            if isinstance(event, BlockStored | BlockRemoved):
                found.update(event.block_hashes)
    return sorted(found)


@pytest.mark.parametrize("name", ["vllm-0.33.0-kv-events.json", "vllm-0.23.0-kv-events.json"])
@pytest.mark.parametrize("drain", [1, 3, 100])
def test_captured_frames_give_the_same_index_and_reports(name: str, drain: int) -> None:
    frames = _captured(name)
    deliveries = [frames[i : i + drain] for i in range(0, len(frames), drain)]
    num_native = feed_both(deliveries, _captured_hashes(frames))
    assert num_native > 0  # plain stores, removals and the clear take it


def test_a_store_of_no_blocks_counts_as_in_python() -> None:
    """No engine hash, no token id, any block size (up to 2**31 here): an aligned store of
    nothing, whose parent is still looked up (an orphan when unknown)."""
    events: list[Event] = [BlockStored((), 7, [], 2**31 - 1, Tier.GPU)]
    frames = [
        encode_live(b"kv@r1@m", seq, encode_batch(events, ts=1.0, rank=0, encoding="map"))
        for seq in range(3)
    ]
    assert feed_both([frames], [7]) == 2  # the first batch makes the stream live


def test_uncommon_events_take_the_python_path() -> None:
    """A LoRA store, extra keys, a placeholder, an uncommon medium: no NativeBatch."""
    store = BlockStored((1,), None, [1, 2], 2, Tier.GPU)
    uncommon: list[Event] = [
        msgspec.structs.replace(store, lora_name="sql-lora"),
        msgspec.structs.replace(store, extra_keys=(("tenant",),)),
        BlockStored((1,), None, (), 0, Tier.CPU),
        BlockRemoved((1,), Tier.OTHER),
    ]
    for event in uncommon:
        for encoding in ("map", "array"):
            payload = encode_batch([event], ts=1.0, rank=0, encoding=encoding)
            assert decode_live_native(encode_live(b"t", 0, payload)) is None
    common = encode_batch([store, AllBlocksCleared()], ts=1.0, rank=0, encoding="map")
    batch = decode_live_native(encode_live(b"t", 7, common))
    assert batch is not None and (batch.seq, batch.ts, batch.num_events) == (7, 1.0, 2)
    assert decode_live_native([b"\xff", encode_seq(7), common]) is None  # topic not UTF-8
    assert decode_live_native([b"t", b"\xff" * 8, common]) is None  # the end marker's seq


def _records(frames: list[bytes]) -> tuple[object, ...]:
    """What the Python path reads of a message, in ``NativeBatch.records`` form."""
    batch = decode_live(frames).batch
    assert batch.num_bad_events == 0
    records: list[tuple[object, ...]] = []
    for event in batch.events:
        if isinstance(event, AllBlocksCleared):
            records.append(("clear",))
        elif event.group_idx not in (None, 0):
            records.append(("other_group",))
        elif isinstance(event, BlockRemoved):
            records.append(("remove", int(event.tier), tuple(event.block_hashes)))
        else:
            assert event.lora_name is None and not event.is_placeholder
            assert event.extra_keys is None or all(k is None for k in event.extra_keys)
            size, hashes = event.block_size, tuple(event.block_hashes)
            if size <= 0 or len(event.token_ids) != len(hashes) * size:
                records.append(("misaligned",))
            else:
                tokens = list(event.token_ids)
                records.append(("store", int(event.tier), event.parent_hash, size, tokens, hashes))
    return batch.seq, repr(batch.ts), batch.rank, records


def _same_reading(frames: list[bytes]) -> bool:
    """Whether the compiled reader took the message; if it did, it read what the Python
    path reads (so the message can only go the compiled way when both agree)."""
    batch = decode_live_native(frames)
    if batch is None:
        return False
    assert (batch.seq, repr(batch.ts), batch.rank, batch.records()) == _records(frames)
    return True


@pytest.mark.parametrize("name", ["vllm-0.33.0-kv-events.json", "vllm-0.23.0-kv-events.json"])
def test_captured_frames_are_read_as_the_python_path_reads_them(name: str) -> None:
    taken = [_same_reading(frames) for frames in _captured(name)]
    # Rank 0's seq0 (extra keys all nil), seq4 (removals), seq5 (the clear), seq6 (bin
    # hashes) and rank 1's three; rank 0's seq1-3 carry a cache salt, a LoRA store, a CPU
    # placeholder: the Python path.
    assert taken == [True, False, False, False, True, True, True, True, True, True]


# --- fuzzed frames ------------------------------------------------------------------------


@st.composite
def _deliveries(draw: st.DrawFn) -> list[list[list[bytes]]]:
    """Fuzzed messages (valid and corrupt), some with their seq moved back or repeated,
    cut into drains of random sizes."""
    found: list[Message] = draw(messages())
    frames = []
    for item in found:
        message = list(item.frames)
        if len(message) == 3 and len(message[1]) == 8 and draw(st.integers(0, 5)) == 0:
            seq = int.from_bytes(message[1], "big")
            message[1] = encode_seq(max(0, seq - draw(st.integers(0, 3))))
        frames.append(message)
    cuts: list[list[list[bytes]]] = []
    while frames:
        size = draw(st.integers(1, 5))
        cuts.append(frames[:size])
        frames = frames[size:]
    return cuts


_FUZZ_HASHES = [*range(12), *range((1 << 64) - 12, 1 << 64)]
"""Every engine hash ``frame_fuzz`` draws."""


@FAST
@given(deliveries=_deliveries())
def test_fuzzed_frames_give_the_same_index_and_reports(
    deliveries: list[list[list[bytes]]],
) -> None:
    feed_both(deliveries, _FUZZ_HASHES)


@FAST
@given(deliveries=_deliveries())
def test_fuzzed_frames_are_read_as_the_python_path_reads_them(
    deliveries: list[list[list[bytes]]],
) -> None:
    for messages_ in deliveries:
        for frames in messages_:
            _same_reading(frames)


# --- random msgpack shaped like events -------------------------------------------------------

_any = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=4)
    | st.binary(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=6,
)
_int = st.integers(-(2**63), 2**64 - 1) | st.sampled_from([0, 1, 4, 2**31, -1])
_wire_hash = st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=33)
_PLAUSIBLE: dict[str, st.SearchStrategy[object]] = {
    "block_hashes": st.lists(_wire_hash, max_size=3),
    "parent_block_hash": st.none() | _wire_hash,
    "token_ids": st.lists(st.integers(0, 9), max_size=6)
    | st.lists(st.integers(0, 9) | st.integers(-1, 2**32), max_size=9),
    "block_size": st.sampled_from([0, 1, 1, 2, 2, 3, -2, 2**31, 2**63]) | _int,
    "lora_id": st.none() | _int,
    "medium": st.sampled_from(
        [None, "GPU", "GPU", "CPU", "CPU", None, "cpu", "DISK", b"GPU", "CPU_PINNED"]
    ),
    "lora_name": st.sampled_from([None] * 8 + ["x"]),
    "extra_keys": st.none() | st.lists(st.sampled_from([None] * 8 + [["salt"]]), max_size=3),
    "group_idx": st.sampled_from([None, None, 0, 0, 1, -1, "0"]),
    "cache_salt": st.sampled_from([None] * 6 + ["tenant-a", 5]),  # SGLang's (maps only)
}
_TAGS = st.sampled_from(["BlockStored"] * 9 + ["BlockRemoved"] * 6 + ["AllBlocksCleared", "X", 5])


@st.composite
def _event_value(draw: st.DrawFn, name: str) -> object:
    return draw(_PLAUSIBLE[name] if draw(st.integers(0, 29)) else _any)


@st.composite
def _map_event(draw: st.DrawFn) -> dict[object, object]:
    names = draw(st.lists(st.sampled_from(sorted(_PLAUSIBLE)), unique=True))
    if "block_hashes" not in names and draw(st.integers(0, 9)):
        names.append("block_hashes")
    fields: list[tuple[object, object]] = [(n, draw(_event_value(n))) for n in names]
    if draw(st.integers(0, 9)):
        fields.append(("type", draw(_TAGS)))
    if not draw(st.integers(0, 4)):
        fields += draw(st.lists(st.tuples(st.sampled_from(["locality", "x", "type"]), _any)))
    return dict(draw(st.permutations(fields)))


@st.composite
def _array_event(draw: st.DrawFn) -> list[object]:
    names = list(_PLAUSIBLE) if draw(st.booleans()) else ["block_hashes", "medium", "group_idx"]
    values = [draw(_event_value(n)) for n in names[: draw(st.integers(0, len(names)))]]
    trailing = draw(st.lists(_any, max_size=2)) if not draw(st.integers(0, 4)) else []
    return [draw(_TAGS), *values, *trailing]


@st.composite
def _shaped_payload(draw: st.DrawFn) -> bytes:
    event = _map_event() if draw(st.booleans()) else _array_event()
    mixed = draw(st.integers(0, 9)) == 0
    events = draw(st.lists(event | _map_event() if mixed else event, max_size=4))
    batch: list[object] = [draw(st.floats()) if draw(st.integers(0, 9)) else draw(_any), events]
    rank = draw(st.integers(0, 9))
    if rank < 8:
        batch.append(draw(st.none() | _int))
    elif rank == 8:
        batch += draw(st.lists(_any, max_size=2))
    return msgspec.msgpack.encode(batch)


@settings(FAST, max_examples=400)
@given(payload=_shaped_payload())
def test_payloads_shaped_like_events_are_read_as_the_python_path_reads_them(
    payload: bytes,
) -> None:
    """The compiled reader declines or agrees, whatever the fields, their order and types."""
    _same_reading([b"kv@r1@m", encode_seq(3), payload])


# --- random chains --------------------------------------------------------------------------

_hash = st.integers(0, POOL - 1)


def _with_tokens(event: BlockStored) -> BlockStored:
    """Two token ids a block, a function of its engine hash (so chains repeat)."""
    tokens = [h % 3 for h in event.block_hashes for _ in (0, 1)]
    return msgspec.structs.replace(event, token_ids=tokens)


_stored = st.builds(
    BlockStored,
    st.lists(_hash, min_size=0, max_size=4).map(tuple),
    st.one_of(st.none(), _hash),
    st.just(()),
    st.just(2),
    st.sampled_from([Tier.GPU, Tier.GPU, Tier.CPU]),
    group_idx=st.sampled_from([None, None, None, 0, 1]),
).map(_with_tokens)
_event: st.SearchStrategy[Event] = st.one_of(
    _stored,
    _stored,
    st.builds(
        BlockRemoved,
        st.lists(_hash, max_size=3).map(tuple),
        st.sampled_from([Tier.GPU, Tier.CPU]),
        st.sampled_from([None, None, 0, 1]),
    ),
    st.just(AllBlocksCleared()),
)


@FAST
@given(
    batches=st.lists(st.lists(_event, max_size=5), max_size=14),
    steps=st.lists(st.sampled_from([1, 1, 1, 1, 0, 2]), min_size=14, max_size=14),
    drain=st.integers(1, 6),
    cache_size=st.sampled_from([0, 2, 4, 65_536]),
    encoding=st.sampled_from(["map", "array"]),
)
def test_random_chains_give_the_same_index_and_reports(
    batches: list[list[Event]], steps: list[int], drain: int, cache_size: int, encoding: str
) -> None:
    frames = []
    seq = -1
    for events, step in zip(batches, steps, strict=False):
        seq += step
        payload = encode_batch(events, ts=float(seq), rank=0, encoding=encoding)  # type: ignore[arg-type]
        frames.append(encode_live(b"kv@r1@m", max(seq, 0), payload))
    assert all(_same_reading(f) for f in frames)  # only common events here
    deliveries = [frames[i : i + drain] for i in range(0, len(frames), drain)]
    feed_both(deliveries, list(range(POOL)), cache_size=cache_size)


# --- the compiled key cache -------------------------------------------------------------

_cache_op = st.one_of(
    st.tuples(st.just("get"), _hash),
    st.tuples(st.just("put"), _hash, st.integers(0, 2**64 - 1)),
    st.tuples(st.just("age")),
)


@FAST
@given(capacity=st.integers(0, 9), ops=st.lists(_cache_op, max_size=60))
def test_the_compiled_key_cache_answers_as_the_python_one(
    capacity: int, ops: list[tuple[Any, ...]]
) -> None:
    compiled, python = native.KeyCache(capacity), PyKeyCache(capacity)
    for op in ops:
        if op[0] == "get":
            assert compiled.get(op[1]) == python.get(op[1])
        elif op[0] == "put":
            compiled.put(op[1], op[2])
            python.put(op[1], op[2])
        else:
            compiled.age()
            python.age()
        assert len(compiled) == len(python.young)
    for engine_hash in range(POOL):
        assert compiled.get(engine_hash) == python.get(engine_hash)


def test_the_compiled_key_cache_takes_only_unsigned_64_bit_hashes() -> None:
    cache = native.KeyCache(4)
    cache.put(0, 7)  # the empty slot's key, kept apart
    assert (cache.get(0), cache.get(2**64 - 1)) == (7, None)
    with pytest.raises(OverflowError):
        cache.put(-1, 1)


# --- the compiled ingest runs without the GIL --------------------------------------------


def _chain_frames(num_batches: int, blocks_per_batch: int) -> tuple[list[list[bytes]], list[int]]:
    """One chain of blocks, a batch of stores at a time (engine hash = block number + 1)."""
    frames, tokens = [], []
    for seq in range(num_batches):
        first = seq * blocks_per_batch + 1
        hashes = tuple(range(first, first + blocks_per_batch))
        block_tokens = [h % 7 for h in hashes for _ in (0, 1)]
        tokens += block_tokens
        event = BlockStored(hashes, first - 1 or None, block_tokens, 2, Tier.GPU)
        payload = encode_batch([event], ts=float(seq), rank=0, encoding="array")
        frames.append(encode_live(b"kv@r1@m", seq, payload))
    return frames, tokens


def test_lookups_during_the_compiled_ingest_see_whole_calls_only() -> None:
    """Another thread's lookups run while the compiled ingest has released the GIL: each
    sees the index between two ``handle_frames`` calls (a whole number of deliveries of
    16 batches after the first batch), never part of one. (The first batch, seq 0, takes
    the Python path: in a delivery of its own, as a delivery's Python batches are applied
    in a lock hold of their own, before its compiled run's translation.)"""
    rig = Rig.of("r1", native_ingest=True, cache_size=0)
    frames, tokens = _chain_frames(num_batches=401, blocks_per_batch=16)
    keys = block_keys(MODEL, tokens, 2)
    rig.pipeline.handle_frames(frames[:1], rig.stream)
    seen: list[int] = []
    done = threading.Event()

    def look() -> None:
        while not done.is_set():
            match = rig.index.longest_prefix(keys, [rig.stream])[rig.stream]
            seen.append(match.num_blocks)

    reader = threading.Thread(target=look)
    reader.start()
    try:
        with native_runs() as counted:
            for start in range(1, len(frames), 16):
                rig.pipeline.handle_frames(frames[start : start + 16], rig.stream)
    finally:
        done.set()
        reader.join()
    assert counted == [16] * 25
    assert rig.index.longest_prefix(keys, [rig.stream])[rig.stream].num_blocks == len(keys)
    assert seen and all((n - 16) % (16 * 16) == 0 for n in seen), sorted(set(seen))
    assert seen == sorted(seen)


def test_a_long_drain_lets_lookups_in_between_its_pieces_at_batch_edges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One ``handle_frames`` call of 2,000 batches, applied in pieces of about 1,024 blocks
    (``HOLD_BLOCKS``): another thread's lookups get in between pieces (the index lock is
    handed over), and each sees a whole number of batches, never part of one."""
    monkeypatch.setattr(memory, "HOLD_BLOCKS", 1024)
    rig = Rig.of("r1", native_ingest=True, cache_size=0)
    frames, tokens = _chain_frames(num_batches=2000, blocks_per_batch=16)
    keys = block_keys(MODEL, tokens, 2)
    rig.pipeline.handle_frames(frames[:1], rig.stream)  # seq 0 starts it the Python way
    seen: list[int] = []
    started, done = threading.Event(), threading.Event()

    def look() -> None:
        while not done.is_set():
            seen.append(rig.index.longest_prefix(keys, [rig.stream])[rig.stream].num_blocks)
            started.set()

    reader = threading.Thread(target=look)
    reader.start()
    try:
        started.wait(5)
        with native_runs() as counted:
            rig.pipeline.handle_frames(frames[1:], rig.stream)
    finally:
        done.set()
        reader.join()
    assert counted == [1999]  # one compiled run, applied in pieces
    assert rig.index.longest_prefix(keys, [rig.stream])[rig.stream].num_blocks == len(keys)
    assert all(n % 16 == 0 for n in seen) and seen == sorted(seen)
    assert any(16 < n < len(keys) for n in seen), "no lookup got in during the drain"
    health = rig.reports[-1]
    assert (health["num_batches"], health["last_seq"]) == (1999, 1999)


# --- the translation ahead of the lock (``KeyCache.translate``, then ``Tables.ingest``) ----


def _native_batches(batches: list[list[Event]], encoding: str = "array") -> list[Any]:
    """Each batch of events as the live path decodes it for the compiled ingest (seq = its
    position); all of these events take that path."""
    out = []
    for seq, events in enumerate(batches):
        payload = encode_batch(events, ts=float(seq), rank=0, encoding=encoding)  # type: ignore[arg-type]
        batch = decode_live_native(encode_live(b"kv@r1@m", seq, payload))
        assert batch is not None
        out.append(batch)
    return out


def _holding(tables: Any) -> tuple[object, ...]:
    return tables.resolve(0, range(POOL)), tables.blocks_by_tier(0)


@FAST
@given(
    batches=st.lists(st.lists(_event, max_size=5), max_size=14),
    drain=st.integers(1, 6),
    cache_size=st.sampled_from([0, 2, 4, 65_536]),
    between=st.sampled_from(["nothing", "reset"]),
)
def test_translating_ahead_then_ingesting_is_ingesting_alone(
    batches: list[list[Event]], drain: int, cache_size: int, between: str
) -> None:
    """Per delivery, ``KeyCache.translate`` then ``Tables.ingest`` gives the counts, the
    watermark, the tables and the cache that ``Tables.ingest`` alone gives, with the
    stream reset (a clear or a drop) between the two phases or not: the reference does
    the reset first. The run stops at a parent the cache lacks, translated on by the
    ingest."""
    ahead, alone = native.Tables(), native.Tables()
    ahead_cache, alone_cache = native.KeyCache(cache_size), native.KeyCache(cache_size)
    root = 12345
    mark_ahead = mark_alone = -1
    decoded = _native_batches(batches)
    for start in range(0, len(decoded), drain):
        piece = decoded[start : start + drain]
        whole = ahead_cache.translate(piece, root)
        assert 0 <= whole <= len(piece)
        assert [b.translated for b in piece] == [i <= whole for i in range(len(piece))][
            : len(piece)
        ]
        if between == "reset":
            ahead.reset(0)
            alone.reset(0)
            mark_ahead = mark_alone = -1
        out_ahead = ahead.ingest(0, piece, ahead_cache, root, mark_ahead)
        assert not any(b.translated for b in piece)  # consumed
        out_alone = alone.ingest(0, piece, alone_cache, root, mark_alone)
        assert out_ahead == out_alone
        mark_ahead = mark_alone = out_ahead[0]
        assert _holding(ahead) == _holding(alone)
    for engine_hash in range(POOL):
        assert ahead_cache.get(engine_hash) == alone_cache.get(engine_hash)


def test_a_translation_stops_at_a_parent_only_the_index_knows() -> None:
    """A store whose parent left the cache (capacity 0: aged out) but is in the stream's
    table: the translation stops there, before changing anything of it, and the ingest
    chains it from the table's key (no orphan)."""
    tables, cache = native.Tables(), native.KeyCache(0)
    first = BlockStored((1, 2), None, [1, 1, 2, 2], 2, Tier.GPU)
    second = BlockStored((3,), 2, [3, 3], 2, Tier.GPU)
    early, late = _native_batches([[first], [second]])
    cache.translate([early], 7)
    tables.ingest(0, [early], cache, 7, -1)
    cache.age()  # capacity 0: every generation is full; 2's key is gone from both
    cache.age()
    assert cache.get(2) is None
    assert cache.translate([late], 7) == 0 and late.translated
    out = tables.ingest(0, [late], cache, 7, 0)
    assert out[0] == 1 and out[10] == 0  # applied, no orphan
    key_2 = tables.resolve(0, [2])[0]
    assert key_2 is not None
    assert tables.resolve(0, [3]) == chain_keys(key_2, tokens_to_bytes([3, 3]), 2, None)


def test_ingest_refuses_a_translation_made_with_another_cache_or_out_of_order() -> None:
    """Refused before anything is applied, the translation given up (the batch can be
    translated again)."""
    tables, cache = native.Tables(), native.KeyCache(16)
    one, two = _native_batches([[BlockStored((1,), None, [1, 1], 2, Tier.GPU)]] * 2)
    cache.translate([two], 7)
    with pytest.raises(ValueError, match="translated ahead"):
        cache.translate([two], 7)
    other = native.KeyCache(16)
    refused: list[Callable[[], object]] = [
        (lambda: tables.ingest(0, [one, two], cache, 7, -1)),  # after one not translated
        (lambda: tables.ingest(0, [two], other, 7, -1)),  # another cache
        (lambda: tables.ingest(0, [two], cache, 8, -1)),  # another root
    ]
    for ingest in refused:
        if not two.translated:
            cache.translate([two], 7)
        with pytest.raises(ValueError, match="translated ahead"):
            ingest()
        assert not two.translated
    assert tables.resolve(0, [1]) == [None]


class _Hooked(native.KeyCache):
    """A compiled key cache that runs ``hook`` after each translation (the first phase of
    ``MemoryIndex.apply_native``, outside the index lock)."""

    hook: Any = None

    def translate(self, batches: list[Any], root: int) -> int:
        whole: int = super().translate(batches, root)
        if self.hook is not None:
            self.hook()
        return whole


@pytest.mark.parametrize("capacity", [2, 16])
@pytest.mark.parametrize("between", ["clear", "drop", "drop-and-reuse"])
def test_a_clear_or_drop_between_the_two_phases_is_one_before_the_ingest(
    between: str, capacity: int
) -> None:
    """``MemoryIndex.apply_native`` with a clear, a drop, or a drop whose number another
    stream takes, made (by another thread: the lock is free) between the translation and
    the ingest: the index and the counts are those of the same change made before the
    whole call (the translation read only the cache), orphans included. A cache of 2
    has lost block 2 by the last batch: only the index (as the change left it) has it."""
    stream, other = StreamId("r1"), StreamId("r2")
    earlier: list[list[Event]] = [
        [BlockStored((1, 2), None, [1, 1, 2, 2], 2, Tier.GPU)],
        [BlockStored((3,), 2, [3, 3], 2, Tier.GPU), BlockRemoved((1,), Tier.GPU)],
    ]
    later: list[list[Event]] = [
        [BlockStored((4,), 3, [4, 4], 2, Tier.GPU)],  # parent in the cache
        [BlockStored((5,), 9, [5, 5], 2, Tier.GPU)],  # 9: nowhere
        [
            BlockStored((6,), 4, [6, 6], 2, Tier.CPU),
            BlockRemoved((3, 8), Tier.GPU),
            BlockStored((7,), 2, [7, 7], 2, Tier.GPU),
        ],
    ]

    def change(index: MemoryIndex) -> None:
        if between == "clear":
            index.clear(stream)
            return
        index.drop(stream)
        if between == "drop-and-reuse":
            held = _native_batches([[BlockStored((4, 5), None, [9, 9, 8, 8], 2, Tier.GPU)]])
            index.apply_native(other, held, native.KeyCache(16), 99)

    def run(*, hooked: bool) -> tuple[object, ...]:
        index = MemoryIndex()
        cache = _Hooked(capacity)
        first = index.apply_native(stream, _native_batches(earlier), cache, 7)
        batches = _native_batches(earlier + later)[len(earlier) :]
        for seq, batch in enumerate(batches, start=len(earlier)):
            assert batch.seq == seq
        if hooked:
            cache.hook = lambda: change(index)
        else:
            change(index)
        counts = index.apply_native(stream, batches, cache, 7)
        stats = index.stats(stream)
        return (
            first, counts, stats.watermark, stats.blocks_by_tier, index.streams(),
            index.resolve(stream, list(range(1, 10))), index.resolve(other, list(range(1, 10))),
        )  # fmt: skip

    hooked = run(hooked=True)
    assert hooked == run(hooked=False)
    counts = hooked[1]
    assert isinstance(counts, tuple)
    assert counts[8] == (2 if capacity == 2 else 1)  # orphans: 9, and 2 if the cache lost it
