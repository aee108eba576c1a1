"""Fuzzing the write path: hypothesis strategies for live frames and replay replies, valid
and corrupt, and the properties the socket-free :class:`~kvindex.indexer.ingest.pipeline.Pipeline`
must keep over them.

One home for both runs: ``tests/unit/indexer/test_wire_fuzz.py`` (short, in CI) and
``bench/fuzz.py`` (long, ``--cases``) draw from the same strategies and check the same
properties.

Valid frames are built with ``kvindex.indexer.ingest.wire``'s own structs and encoders; every hash
is sent in one of vLLM's forms (a non-negative int, the same value as a negative int, a
32-byte digest ending in it), so all of them must land on the same blocks. Corrupt frames
are valid ones broken in a way that makes them undecodable *by construction* (so the
expected outcome does not depend on the decoder under test):

* frame level (no readable seq): wrong frame count, a short or long seq frame, the replay
  end marker's seq, a topic that is not UTF-8;
* payload level (seq readable): truncated msgpack, a byte no msgpack uses, trailing bytes,
  a batch of the wrong shape or field types, nesting deeper than the decoder allows;
* event level (the batch survives): an unknown tag, a missing field, a field of the wrong
  type, deep nesting, arbitrary msgpack values that name no event;
* random byte flips of a payload: valid or not as the decoder says (then judged like the
  rest: an accepted frame is a valid frame).

Properties, for a pipeline fed everything (``fuzzed``) against one fed only the valid
frames (``reference``; a frame whose payload alone was bad is, for it, an empty batch at
that seq, which is what the pipeline makes of it): no call raises; every undecodable frame
is counted once in ``num_decode_errors`` and every undecodable event once in
``num_bad_events``; both apply the same batches; and the two indexes hold exactly the same
blocks (stats, engine hash → key, best tier of every key).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import msgspec
from hypothesis import strategies as st

from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.domain.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    StreamId,
    Tier,
)
from kvindex.indexer.domain.health import StreamCounters, StreamHealth
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.ingest.pipeline import MAX_TOPIC_RANKS, Pipeline
from kvindex.indexer.ingest.wire import (
    END_SEQ_BYTES,
    BlockStoredArray,
    Encoding,
    ReplayLayout,
    ReplayReply,
    WireError,
    decode_payload,
    decode_replay,
    encode_batch,
    encode_live,
    encode_replay_end,
    encode_replay_reply,
    to_wire,
)

MODEL = "m"
BLOCK = 4
R1 = StreamId("r1")
TOPIC = f"kv@r1@{MODEL}".encode()
REPLAY = "tcp://127.0.0.1:5558"
_U64 = 1 << 64
_HASH_POOL = 12
"""Engine hashes are drawn from a small pool (offset into the high u64 range too), so that
stores chain, removals hit and clears matter."""
_HIGH = _U64 - _HASH_POOL
_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
_UNKNOWN_TS = -1.0
"""The ts the pipeline gives a batch whose payload could not be read (pipeline.py)."""
_DEEP = 20_000
"""Nesting far past what msgspec recurses into (wire.py then walks the batch itself)."""

Kind: TypeAlias = Literal["valid", "frame", "payload"]


@dataclass(frozen=True, slots=True)
class Message:
    """One live message: what the fuzzed pipeline gets, and what the reference gets."""

    frames: list[bytes]
    reference: list[bytes] | None
    """None: nothing (a frame with no readable seq names no batch)."""
    kind: Kind
    num_junk_events: int = 0


# --- valid events, in every wire form --------------------------------------------------

_engine_hash = st.one_of(st.integers(0, _HASH_POOL - 1), st.integers(_HIGH, _U64 - 1))
_token = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([-1, 2**32, 2**63, 2**64 - 1]))
"""Mostly valid token ids; sometimes one out of range (a bad event, for both pipelines)."""


@st.composite
def _stored(draw: st.DrawFn) -> BlockStored:
    hashes = tuple(draw(st.lists(_engine_hash, min_size=1, max_size=3)))
    size = draw(st.sampled_from([BLOCK, BLOCK, BLOCK, 0, -BLOCK, 2**63]))
    count = len(hashes) * size if 0 < size <= BLOCK else draw(st.integers(0, 5))
    token_ids = draw(st.lists(_token, min_size=count, max_size=count))
    return BlockStored(
        hashes,
        draw(st.one_of(st.none(), _engine_hash)),
        token_ids,
        size,
        draw(st.sampled_from(Tier)),
        group_idx=draw(st.sampled_from([None, None, 0, 1])),
    )


_events: st.SearchStrategy[Event] = st.one_of(
    _stored(),
    _stored(),
    st.builds(
        BlockRemoved,
        st.lists(_engine_hash, max_size=3).map(tuple),
        st.sampled_from(Tier),
        st.sampled_from([None, 0, 1]),
    ),
    st.just(AllBlocksCleared()),
)


def _hash_form(value: int, form: int) -> int | bytes:
    """One of vLLM's forms of a u64 engine hash: as is, as a negative int (Python
    ``hash()``), or as a 32-byte digest ending in it."""
    if form == 1 and value >= 1 << 63:
        return value - _U64
    if form == 2:
        return os.urandom(24) + value.to_bytes(8, "big")
    return value


def _wire_event(event: Event, encoding: Encoding, form: int) -> Any:
    """The wire struct vLLM would send for ``event``, its hashes in ``form``."""
    wire = to_wire(event, encoding)
    if isinstance(event, BlockStored):
        parent = event.parent_hash
        return msgspec.structs.replace(
            wire,
            block_hashes=[_hash_form(h, form) for h in event.block_hashes],
            parent_block_hash=None if parent is None else _hash_form(parent, form),
        )
    if isinstance(event, BlockRemoved):
        hashes = [_hash_form(h, form) for h in event.block_hashes]
        return msgspec.structs.replace(wire, block_hashes=hashes)
    return wire


# --- events that cannot decode ----------------------------------------------------------

_WRONG_TYPES: dict[str, list[Any]] = {
    "block_hashes": ["x", 1.5, None, [1.5], [[1]], [{"a": 1}], [True], {"a": 1}],
    "parent_block_hash": ["x", 1.5, [1], True],
    "token_ids": ["x", [1.5], ["a"], [None], 7],
    "block_size": ["x", 1.5, None, [4], True],
    "medium": [5, 1.5, [b"GPU"]],
    "lora_name": [5, [1]],
    "group_idx": ["x", 1.5, [0]],
}
_ARRAY_POSITION = {  # where the array encoding puts each field: after the tag, in wire order
    f.name: i for i, f in enumerate(msgspec.structs.fields(BlockStoredArray), start=1)
}
_STORED_FIELDS = sorted(_WRONG_TYPES)


def _deep(depth: int = _DEEP) -> msgspec.Raw:
    return msgspec.Raw(b"\x91" * depth + b"\xc0")  # [[[...[nil]...]]]


@st.composite
def _wrong_field(draw: st.DrawFn) -> Any:
    """A BlockStored with one field of the wrong type, as a map or an array."""
    stored = draw(_stored())
    name = draw(st.sampled_from(_STORED_FIELDS))
    bad = draw(st.sampled_from([*_WRONG_TYPES[name], _deep()]))
    if draw(st.booleans()) or name not in _ARRAY_POSITION:
        fields = msgspec.to_builtins(to_wire(stored, "map"))
        return fields | {name: bad}
    items = msgspec.to_builtins(to_wire(stored, "array"))
    items[_ARRAY_POSITION[name]] = bad
    return items


msgpack_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=12),
        st.binary(max_size=40),
        st.sampled_from([*sorted(_TAGS), "type"]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=20,
)
"""Any msgpack-encodable value, often shaped like an event (a tag, a ``type`` key)."""


def _names_no_event(value: Any) -> bool:
    """True unless ``value`` is tagged like an event (a list led by a tag, a map with a
    ``type``): a tag and nothing else is a valid ``AllBlocksCleared``."""
    if isinstance(value, list):
        return not (value and isinstance(value[0], str) and value[0] in _TAGS)
    return not (isinstance(value, dict) and "type" in value)


_junk_events: st.SearchStrategy[Any] = st.one_of(
    _wrong_field(),
    st.sampled_from(
        [
            {"type": "BlockFrobbed", "block_hashes": [1]},
            ["BlockFrobbed", [1]],
            {"type": "BlockStored"},
            ["BlockStored", [1]],
            ["BlockRemoved"],
            {"type": "BlockRemoved", "medium": "GPU"},
            {"type": 5},
        ]
    ),
    st.sampled_from([_deep(), _deep(50), msgspec.Raw(b"\x81\xa1k" * 5_000 + b"\xc0")]),
    msgpack_values.filter(_names_no_event),
)


# --- messages ---------------------------------------------------------------------------


@st.composite
def _payload(draw: st.DrawFn) -> tuple[bytes, bytes, int]:
    """A batch payload of valid events (each in either encoding, hashes in any form) with
    junk events among them; returns it, the same payload without the junk, and how many
    junk events it holds."""
    items: list[Any] = []
    num_junk = 0
    for event in draw(st.lists(_events, max_size=4)):
        encoding: Encoding = draw(st.sampled_from(["map", "array"]))
        items.append(_wire_event(event, encoding, draw(st.integers(0, 2))))
    clean = list(items)
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        items.insert(draw(st.integers(0, len(items))), draw(_junk_events))
        num_junk += 1
    ts = draw(st.one_of(st.floats(), st.integers(0, 2**40)))
    rank = draw(st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)))
    encode = msgspec.msgpack.encode
    return encode([ts, items, rank]), encode([ts, clean, rank]), num_junk


def _bad_payloads(valid: bytes) -> st.SearchStrategy[bytes]:
    """Payloads that cannot decode as a batch, whatever the decoder makes of events."""
    encode = msgspec.msgpack.encode
    return st.one_of(
        st.integers(0, len(valid) - 1).map(lambda k: valid[:k]),
        st.binary(max_size=30).map(lambda tail: b"\xc1" + tail),
        st.binary(min_size=1, max_size=4).map(lambda tail: valid + tail),
        st.sampled_from(
            [
                encode(["x", [], 0]),
                encode([0.0, 5, 0]),
                encode([0.0, [], "x"]),
                encode([0.0]),
                encode({"ts": 0.0, "events": []}),
                encode(7),
                encode([_deep(), [], 0]),
                encode([0.0, [], _deep()]),
                encode([0.0, msgspec.Raw(b"\x81\xa1k" * _DEEP + b"\xc0"), 0]),
            ]
        ),
    )


def _flipped(valid: bytes) -> st.SearchStrategy[bytes]:
    def flip(at_and_byte: tuple[int, int]) -> bytes:
        at, byte = at_and_byte
        return valid[:at] + bytes([byte]) + valid[at + 1 :]

    return st.tuples(st.integers(0, len(valid) - 1), st.integers(0, 255)).map(flip)


def _empty_batch(seq: int) -> list[bytes]:
    """What the pipeline makes of a frame whose payload alone was bad (seq readable)."""
    return encode_live(TOPIC, seq, encode_batch([], ts=_UNKNOWN_TS, rank=0, encoding="map"))


def _bad_frames(frames: list[bytes]) -> st.SearchStrategy[list[bytes]]:
    """Frames with no readable seq (wrong count, seq length, end marker, topic)."""
    topic, seq, payload = frames
    return st.one_of(
        st.sampled_from(
            [
                [],
                frames[:1],
                frames[:2],
                [*frames, b""],
                [*frames, payload],
                [topic, END_SEQ_BYTES, payload],
                [b"\xff" + topic, seq, payload],
                [b"kv@\xc3(@m", seq, payload],
            ]
        ),
        st.integers(0, 16)
        .filter(lambda n: n != len(seq))
        .map(lambda n: [topic, (seq * 3)[:n], payload]),
    )


@st.composite
def message(draw: st.DrawFn, seq: int) -> Message:
    """A live message of ``seq``: valid (maybe with junk events), or corrupt."""
    payload, clean, num_junk = draw(_payload())
    frames = encode_live(TOPIC, seq, payload)
    kind = draw(st.sampled_from(["valid", "valid", "valid", "frame", "payload", "flip"]))
    if kind == "frame":
        return Message(draw(_bad_frames(frames)), None, "frame")
    if kind == "payload":
        broken = encode_live(TOPIC, seq, draw(_bad_payloads(payload)))
        return Message(broken, _empty_batch(seq), "payload")
    if kind == "flip":
        return _judged(encode_live(TOPIC, seq, draw(_flipped(payload))), seq)
    return Message(frames, encode_live(TOPIC, seq, clean), "valid", num_junk)


def _judged(frames: list[bytes], seq: int) -> Message:
    """A flipped payload is valid or not as the decoder says (a valid one goes to both
    pipelines as it is, its bad events with it)."""
    try:
        decode_payload(frames[2], seq)
    except WireError:
        return Message(frames, _empty_batch(seq), "payload")
    return Message(frames, frames, "valid")


@st.composite
def messages(draw: st.DrawFn, max_size: int = 12) -> list[Message]:
    """Live messages of one stream: seqs rise from 0, some skipped (gaps), none repeated."""
    found: list[Message] = []
    seq = 0
    for _ in range(draw(st.integers(0, max_size))):
        seq += draw(st.sampled_from([1, 1, 1, 1, 2, 5]))
        found.append(draw(message(seq)))
    return found


# --- replay replies ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reply:
    """One replay reply as a DEALER receives it; ``valid`` if it decodes to a batch."""

    frames: list[bytes]
    valid: bool


@st.composite
def reply(draw: st.DrawFn, seq: int) -> Reply:
    payload, _, _ = draw(_payload())
    layout: ReplayLayout = draw(st.sampled_from(["topic", "legacy"]))
    frames = [b"", *encode_replay_reply(seq, payload, topic=TOPIC, layout=layout)]
    kind = draw(st.sampled_from(["valid", "valid", "framing", "payload"]))
    if kind == "framing":
        bad = draw(
            st.sampled_from(
                [frames[1:], [b"x", *frames[1:]], [*frames, b"x"], frames[:2], [b"", b"\xff"]]
            )
        )
        if layout == "topic":
            bad = draw(st.sampled_from([bad, [b"", b"\xff" + TOPIC, *frames[2:]]]))
        return Reply(bad, valid=False)
    if kind == "payload":
        broken = draw(_bad_payloads(payload).filter(bool))  # empty: the end marker
        return Reply([*frames[:-1], broken], valid=False)
    return Reply(frames, valid=True)


@st.composite
def replies(draw: st.DrawFn, max_size: int = 10) -> list[Reply]:
    found: list[Reply] = []
    seq = -1
    for _ in range(draw(st.integers(0, max_size))):
        seq += draw(st.sampled_from([1, 1, 1, 2]))
        found.append(draw(reply(seq)))
    return found


# --- the pipelines and the properties ----------------------------------------------------


@dataclass
class Replays:
    """The socket owner's side of replays: counts undecodable replies as the replay
    session does (``kvindex.indexer.ingest.replay``)."""

    open: set[StreamId] = field(default_factory=set)
    num_bad_frames: int = 0

    def start_replay(self, stream: StreamId, endpoint: str, start_seq: int) -> None:
        assert stream not in self.open, "a replay was started over an open one"
        self.open.add(stream)

    def end_replay(self, stream: StreamId) -> int:
        assert stream in self.open, "ended a replay that was not open"
        self.open.discard(stream)
        bad, self.num_bad_frames = self.num_bad_frames, 0
        return bad


@dataclass
class Rig:
    pipeline: Pipeline
    index: MemoryIndex
    registry: Registry
    replays: Replays

    @classmethod
    def connected(cls, *, replay: bool) -> Rig:
        spec = ReplicaSpec("r1", MODEL, replay=REPLAY if replay else None)
        settings = IndexerSettings(replicas=(spec,))
        registry = Registry(settings.replicas)
        index, replays = MemoryIndex(), Replays()
        pipeline = Pipeline(settings, index, registry, replays=replays if replay else None)
        pipeline.track(R1, spec)
        return cls(pipeline, index, registry, replays)

    @classmethod
    def bound(cls) -> Rig:
        """The bound SUB's pipeline: no replica known beforehand, each topic registers its
        own (``kv@r1@m``) on its first readable batch; no replay endpoint."""
        settings = IndexerSettings()
        registry = Registry()
        index, replays = MemoryIndex(), Replays()
        return cls(Pipeline(settings, index, registry), index, registry, replays)

    def totals(self) -> StreamCounters:
        """Every stream's counters, added."""
        totals = StreamCounters()
        for health in self.registry.records().values():
            totals.add(health)
        return totals

    def health(self) -> StreamHealth:
        status = self.registry.status(R1)
        assert status is not None
        return status.health

    def blocks(self) -> tuple[object, ...]:
        """Everything the index holds for r1, through its public calls: stats, engine
        hash → key for every hash the fuzzer draws, and the best tier of each key."""
        stats = self.index.stats(R1)
        hashes = [*range(_HASH_POOL), *range(_HIGH, _U64)]
        keys = self.index.resolve(R1, hashes)
        tiers = [
            None if k is None else self.index.longest_prefix([k], [R1])[R1].tiers for k in keys
        ]
        return stats.watermark, stats.blocks_by_tier, tuple(keys), tuple(tiers)


def check_live(batch: list[Message]) -> None:
    """Every live message through one pipeline, the valid ones alone through another: the
    same index, every bad frame and event counted, nothing raised."""
    fuzzed, reference = Rig.connected(replay=False), Rig.connected(replay=False)
    for item in batch:
        fuzzed.pipeline.handle_live(item.frames, R1)
        if item.reference is not None:
            reference.pipeline.handle_live(item.reference, R1)
    _expect_counts(fuzzed, reference, batch)
    assert fuzzed.blocks() == reference.blocks()


def check_bound(batch: list[Message]) -> None:
    """The same messages through the bound SUB: a frame that names no readable batch
    reaches no stream (nothing tells which stream's seq it held) and is counted once as
    unrouted undecodable; the reference gets the valid messages alone (so both see the
    same seqs, gaps included), and the two indexes and streams end the same."""
    fuzzed, reference = Rig.bound(), Rig.bound()
    for item in batch:
        fuzzed.pipeline.handle_live(item.frames, None)
        if item.kind == "valid" and item.reference is not None:
            reference.pipeline.handle_live(item.reference, None)
    num_bad = sum(item.kind != "valid" for item in batch)
    assert fuzzed.pipeline.counters.num_undecodable == num_bad
    assert reference.pipeline.counters.num_undecodable == 0
    assert fuzzed.registry.stream_ids() == reference.registry.stream_ids()
    assert fuzzed.pipeline.counters.num_refused == reference.pipeline.counters.num_refused
    got, want = fuzzed.totals(), reference.totals()  # a payload's rank picks the stream
    num_junk = sum(i.num_junk_events for i in batch if i.kind == "valid" and _routed(i))
    assert got.num_bad_events - want.num_bad_events == num_junk
    assert got.num_batches == want.num_batches
    assert fuzzed.blocks() == reference.blocks()


def _routed(item: Message) -> bool:
    """Whether a valid message's batch reaches a stream on the bound SUB (a rank out of
    range is refused, its events unread)."""
    assert item.reference is not None
    rank = decode_payload(item.reference[2], 0).rank
    return 0 <= rank < MAX_TOPIC_RANKS


def _expect_counts(fuzzed: Rig, reference: Rig, batch: list[Message]) -> None:
    got, want = fuzzed.health(), reference.health()
    num_frames_bad = sum(item.kind != "valid" for item in batch)
    assert (got.num_decode_errors, want.num_decode_errors) == (num_frames_bad, 0)
    num_junk = sum(item.num_junk_events for item in batch)
    assert got.num_bad_events - want.num_bad_events == num_junk
    num_read = sum(item.kind != "frame" for item in batch)
    assert got.num_batches == want.num_batches == num_read


def check_replay(found: list[Reply]) -> None:
    """A resync whose replay replies are partly undecodable (counted by the replay
    session, handed over at its end): the same index as with the decodable replies alone,
    every undecodable reply counted once."""
    fuzzed, reference = Rig.connected(replay=True), Rig.connected(replay=True)
    end = decode_replay([b"", *encode_replay_end("topic")])
    for rig, only_valid in ((fuzzed, False), (reference, True)):
        rig.pipeline.on_connected(R1)
        decoded = _decoded(rig, [r for r in found if r.valid or not only_valid])
        rig.pipeline.on_replay(R1, [*decoded, end])
    assert fuzzed.health().num_decode_errors == sum(not r.valid for r in found)
    assert reference.health().num_decode_errors == 0
    assert fuzzed.blocks() == reference.blocks()


def _decoded(rig: Rig, found: list[Reply]) -> list[ReplayReply]:
    decoded = []
    for item in found:
        try:
            decoded.append(decode_replay(item.frames))
        except WireError:
            assert not item.valid, f"a valid reply was refused: {item.frames!r}"
            rig.replays.num_bad_frames += 1
            continue
        assert item.valid, f"a corrupt reply decoded: {item.frames!r}"
    return decoded
