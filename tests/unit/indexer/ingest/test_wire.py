"""kvindex.indexer.ingest.wire: golden captures of vLLM's own publisher, both directions, then
malformed and random input, then round trips.

The golden decoding tests derive every expected value from the capture's ``payload_decoded``
with a small generic comparer (array events via ``meta.struct_config``, map events by name),
so each vector is checked field by field; the golden encoding tests rebuild every captured
frame byte for byte. They are never skipped (tests/fixtures/PROVENANCE.md). Hand-made input
is built with the module's own structs (corrupted with ``msgspec.structs.replace`` where it
must be bad), so no field layout is spelled out here.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.indexer.domain.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    Tier,
)
from kvindex.indexer.ingest.wire import (
    END_SEQ,
    AllBlocksClearedArray,
    AllBlocksClearedMap,
    BlockRemovedArray,
    BlockRemovedMap,
    BlockStoredArray,
    BlockStoredMap,
    Encoding,
    EventBatchMap,
    ReplayLayout,
    ReplayReply,
    VllmArrayEvent,
    VllmBlockRemovedMap,
    VllmBlockStoredArray,
    VllmBlockStoredMap,
    VllmMapEvent,
    WireError,
    WireEvent,
    WireHash,
    decode_live,
    decode_payload,
    decode_replay,
    decode_replay_request,
    decode_seq,
    encode_batch,
    encode_live,
    encode_replay_end,
    encode_replay_reply,
    encode_replay_request,
    encode_seq,
    payload_shape,
)
from tests.support.frame_fuzz import msgpack_values
from tests.support.paths import FIXTURES

FIXTURE_SHA256 = {
    "vllm-0.33.0-kv-events.json": (
        "c25585f886442a2149de7a4ceb797fbad2f09f38082c29c57bef2635a573c834"
    ),
    "vllm-0.23.0-kv-events.json": (
        "bf57d4fa655952514c340a1792567a12cec7250855531abafe5b9511d18fbcb1"
    ),
}
U64 = 1 << 64
TOPIC = b"kv@pod-a@demo-model"
SEQ0 = encode_seq(0)
ENCODE = msgspec.msgpack.encode
ENCODING_OF_VERSION: dict[str, Encoding] = {"0.33.0": "map", "0.23.0": "array"}
LAYOUT_OF_VERSION: dict[str, ReplayLayout] = {"0.33.0": "topic", "0.23.0": "legacy"}
VLLM_BATCH_DECODERS: dict[Encoding, msgspec.msgpack.Decoder[Any]] = {
    "map": msgspec.msgpack.Decoder(tuple[float, list[VllmMapEvent], int]),
    "array": msgspec.msgpack.Decoder(tuple[float, list[VllmArrayEvent], int]),
}
"""Whole batches of vLLM's structs (every field, as vLLM wrote them)."""


@dataclass(frozen=True)
class Vector:
    """One captured message and the file (vLLM version) it comes from."""

    version: str
    meta: dict[str, Any]
    raw: dict[str, Any]

    @property
    def id(self) -> str:
        return str(self.raw["id"])

    @property
    def frames(self) -> list[bytes]:
        return [base64.b64decode(f) for f in self.raw["frames_b64"]]

    @property
    def payload(self) -> list[Any]:
        payload: list[Any] = self.raw["payload_decoded"]
        return payload

    @property
    def encoding(self) -> Encoding:
        return ENCODING_OF_VERSION[self.version]

    @property
    def layout(self) -> ReplayLayout:
        return LAYOUT_OF_VERSION[self.version]

    @property
    def has_bin_hashes(self) -> bool:
        return "bytes_hex" in json.dumps(self.payload)


def _load(name: str) -> list[Vector]:
    data = json.loads((FIXTURES / name).read_text(encoding="utf-8"))
    meta = data["meta"]
    return [Vector(meta["vllm_version"], meta, raw) for raw in data["vectors"]]


VECTORS = [vector for name in FIXTURE_SHA256 for vector in _load(name)]


def _params(channel: str) -> list[Any]:
    chosen = [v for v in VECTORS if v.raw["channel"] == channel]
    return [pytest.param(v, id=f"{v.version}/{v.id}") for v in chosen]


# --- the generic comparer: payload_decoded → expected domain view ---------------------


def _u64(value: Any) -> int | None:
    """A recorded hash as the decoder must normalise it (None stays None)."""
    if value is None:
        return None
    if isinstance(value, dict):
        return int.from_bytes(bytes.fromhex(value["bytes_hex"])[-8:], "big")
    assert isinstance(value, int)
    return value % U64


def _expected_tier(medium: str | None) -> Tier:
    if medium is None:
        return Tier.GPU
    return {"gpu": Tier.GPU, "cpu": Tier.CPU}.get(medium.casefold(), Tier.OTHER)


def _fields(raw_event: Any, struct_config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(tag, fields by name) of a recorded event, in either encoding."""
    if isinstance(raw_event, dict):
        fields = dict(raw_event)
        return str(fields.pop("type")), fields
    tag, *values = raw_event
    names = struct_config.get(f"{tag}_fields", [])
    assert len(values) <= len(names), f"{tag}: more elements than known fields"
    return str(tag), dict(zip(names, values, strict=False))


def _expected_view(tag: str, fields: dict[str, Any]) -> dict[str, Any]:
    if tag == "AllBlocksCleared":
        return {"type": tag}
    view = {
        "type": tag,
        "block_hashes": [_u64(h) for h in fields["block_hashes"]],
        "tier": _expected_tier(fields.get("medium")),
        "group_idx": fields.get("group_idx"),
    }
    if tag == "BlockStored":
        view["parent_hash"] = _u64(fields.get("parent_block_hash"))
        view["token_ids"] = fields["token_ids"]
        view["block_size"] = fields["block_size"]
        view["lora_name"] = fields.get("lora_name")
        view["extra_keys"] = fields.get("extra_keys")
    return view


def _plain(value: object) -> object:
    """Domain values in payload_decoded's vocabulary: sequences as lists, bytes as hex."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return {"bytes_hex": value.hex()}
    return value


def _actual_view(event: Event) -> dict[str, Any]:
    view: dict[str, Any] = {"type": type(event).__name__}
    if isinstance(event, BlockStored | BlockRemoved):
        view["block_hashes"] = list(event.block_hashes)
        view["tier"] = event.tier
        view["group_idx"] = event.group_idx
    if isinstance(event, BlockStored):
        view["parent_hash"] = event.parent_hash
        view["token_ids"] = list(event.token_ids)
        view["block_size"] = event.block_size
        view["lora_name"] = event.lora_name
        view["extra_keys"] = _plain(event.extra_keys)
    return view


def _assert_batch_matches(batch: EventBatch, vector: Vector) -> None:
    ts, raw_events, rank = vector.payload
    config = vector.meta["struct_config"]
    assert batch.seq == vector.raw["seq"]
    assert batch.ts == ts
    assert batch.rank == rank
    assert batch.num_bad_events == 0
    assert [type(e).__name__ for e in batch.events] == vector.raw["event_types"]
    expected = [_expected_view(*_fields(e, config)) for e in raw_events]
    assert [_actual_view(e) for e in batch.events] == expected


# --- golden -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FIXTURE_SHA256))
def test_fixture_is_the_unedited_capture(name: str) -> None:
    digest = hashlib.sha256((FIXTURES / name).read_bytes()).hexdigest()
    assert digest == FIXTURE_SHA256[name]


@pytest.mark.parametrize("version", ["0.33.0", "0.23.0"])
def test_fixture_has_every_vector(version: str) -> None:
    channels = [v.raw["channel"] for v in VECTORS if v.version == version]
    assert channels.count("pub") == 10
    assert channels.count("replay-reply") == 10
    assert channels.count("replay-request") == 1


@pytest.mark.parametrize("vector", _params("pub"))
def test_live_vector_decodes_to_recorded_content(vector: Vector) -> None:
    message = decode_live(vector.frames)
    assert message.topic == vector.raw["topic"]
    _assert_batch_matches(message.batch, vector)


@pytest.mark.parametrize("vector", _params("replay-reply"))
def test_replay_vector_decodes_to_recorded_content(vector: Vector) -> None:
    delimited = vector.id != "replay-reply-via-REQ"
    reply = decode_replay(vector.frames, delimited=delimited)
    # vLLM ≥ 0.26 puts the topic frame in replies (empty in the end marker); 0.23 does not.
    assert reply.topic == vector.raw.get("topic")
    assert (reply.topic is not None) == (vector.version == "0.33.0")
    assert reply.seq == vector.raw["seq"]
    assert reply.is_end == (vector.raw["seq"] == END_SEQ)
    if reply.batch is not None:
        _assert_batch_matches(reply.batch, vector)


@pytest.mark.parametrize("vector", _params("replay-request"))
def test_replay_request_matches_capture(vector: Vector) -> None:
    assert vector.raw["seq"] == 3
    assert encode_replay_request(3) == vector.frames
    assert decode_replay_request(vector.frames) == 3


@pytest.mark.parametrize("version", ["0.33.0", "0.23.0"])
def test_bin_hashes_normalise_to_vllm_int_projection(version: str) -> None:
    by_id = {v.id: v for v in VECTORS if v.version == version}
    chain = by_id["pub-rank0-seq6"].meta["hashing"]["chain_event_int"]
    stored, removed = decode_live(by_id["pub-rank0-seq6"].frames).batch.events
    as_ints = decode_live(by_id["pub-rank0-seq0"].frames).batch.events[0]
    assert isinstance(stored, BlockStored)
    assert isinstance(removed, BlockRemoved)
    assert isinstance(as_ints, BlockStored)
    assert list(stored.block_hashes) == chain[:2] == list(as_ints.block_hashes)
    assert list(removed.block_hashes) == chain[1:2]


def test_replay_request_clamps_negative_start() -> None:
    assert encode_replay_request(-5) == [b"", SEQ0]


# --- golden, the other way: what vLLM sent, rebuilt byte for byte ---------------------


@pytest.mark.parametrize("version", ["0.33.0", "0.23.0"])
def test_the_structs_have_vllms_fields_in_vllms_order(version: str) -> None:
    config = next(v.meta["struct_config"] for v in VECTORS if v.version == version)
    stored, removed = (
        (VllmBlockStoredMap, VllmBlockRemovedMap)
        if ENCODING_OF_VERSION[version] == "map"
        else (VllmBlockStoredArray, BlockRemovedArray)
    )
    assert list(stored.__struct_fields__) == config["BlockStored_fields"]
    assert list(removed.__struct_fields__) == config["BlockRemoved_fields"]


@pytest.mark.parametrize("vector", _params("pub"))
def test_captured_payload_decodes_to_structs_that_encode_back_byte_for_byte(
    vector: Vector,
) -> None:
    payload = vector.frames[2]
    batch = VLLM_BATCH_DECODERS[vector.encoding].decode(payload)
    assert ENCODE(batch) == payload


@pytest.mark.parametrize("vector", _params("pub"))
def test_decoded_events_encode_as_vllm_sent_them(vector: Vector) -> None:
    """Everything but the hash's form survives the domain: a digest comes back as its int."""
    message = decode_live(vector.frames)
    batch = message.batch
    payload = encode_batch(batch.events, ts=batch.ts, rank=batch.rank, encoding=vector.encoding)
    frames = encode_live(message.topic.encode(), batch.seq, payload)
    if vector.has_bin_hashes:
        assert decode_live(frames) == message
    else:
        assert frames == vector.frames


@pytest.mark.parametrize("vector", _params("replay-reply"))
def test_replay_replies_are_rebuilt_as_vllm_sent_them(vector: Vector) -> None:
    frames = vector.frames
    if vector.id != "replay-reply-via-REQ":
        frames = frames[1:]  # the DEALER's empty delimiter frame
    seq = vector.raw["seq"]
    if seq == END_SEQ:
        assert encode_replay_end(vector.layout) == frames
    else:
        topic = vector.raw.get("topic", "").encode()
        assert encode_replay_reply(seq, frames[-1], topic=topic, layout=vector.layout) == frames


# --- malformed frames -----------------------------------------------------------------

EMPTY_BATCH = ENCODE([1.0, [], 0])
# A complete, valid msgpack batch whose events nest 100 000 arrays deep: msgspec gives up
# with RecursionError, which the decoder must turn into WireError.
# The events field itself nested past msgspec's depth (a map of maps): the batch is bad. One
# deep *event* in a list costs only itself (test_wire_fuzz.py).
DEEPLY_NESTED = b"\x93" + ENCODE(1.0) + b"\x81\xa1k" * 100_000 + b"\xc0" + ENCODE(0)


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([], id="no-frames"),
        pytest.param([TOPIC, SEQ0], id="two-frames"),
        pytest.param([TOPIC, SEQ0, EMPTY_BATCH, b""], id="four-frames"),
        pytest.param([TOPIC, b"\x00" * 7, EMPTY_BATCH], id="7-byte-seq"),
        pytest.param([TOPIC, b"\x00" * 9, EMPTY_BATCH], id="9-byte-seq"),
        pytest.param([b"\xff\xfekv", SEQ0, EMPTY_BATCH], id="non-utf8-topic"),
        pytest.param([TOPIC, SEQ0, b""], id="empty-payload"),
        pytest.param([TOPIC, SEQ0, b"\xc1garbage"], id="garbage-payload"),
        pytest.param([TOPIC, SEQ0, ENCODE({"ts": 1.0, "events": []})], id="map-payload"),
        pytest.param([TOPIC, SEQ0, ENCODE([1.0])], id="batch-without-events"),
        pytest.param([TOPIC, SEQ0, ENCODE([1.0, "events", 0])], id="events-not-a-list"),
        pytest.param([TOPIC, SEQ0, ENCODE(["ts", [], 0])], id="ts-not-a-number"),
        pytest.param([TOPIC, SEQ0, EMPTY_BATCH + b"\x00"], id="trailing-bytes"),
        pytest.param([TOPIC, SEQ0, DEEPLY_NESTED], id="deeply-nested-events"),
    ],
)
def test_malformed_live_message_raises_wire_error(frames: list[bytes]) -> None:
    with pytest.raises(WireError):
        decode_live(frames)


@pytest.mark.parametrize(
    ("frames", "delimited"),
    [
        pytest.param([], True, id="no-frames"),
        pytest.param([SEQ0, EMPTY_BATCH], True, id="missing-delimiter"),
        pytest.param([b"", SEQ0], True, id="one-frame-after-delimiter"),
        pytest.param([b"", TOPIC, SEQ0, EMPTY_BATCH, b""], True, id="five-frames"),
        pytest.param([b"", b"\x00" * 7, EMPTY_BATCH], True, id="7-byte-seq"),
        pytest.param([b"", b"\xff", SEQ0, EMPTY_BATCH], True, id="non-utf8-topic"),
        pytest.param([b"", SEQ0, b"\xc1"], True, id="garbage-payload"),
        pytest.param([SEQ0], False, id="req-one-frame"),
    ],
)
def test_malformed_replay_reply_raises_wire_error(frames: list[bytes], delimited: bool) -> None:
    with pytest.raises(WireError):
        decode_replay(frames, delimited=delimited)


# --- events inside a batch ------------------------------------------------------------


def _stored(encoding: Encoding, hashes: list[WireHash], **fields: Any) -> WireEvent:
    """vLLM's BlockStored struct (no tokens unless given), with ``fields`` set."""
    values: dict[str, Any] = {
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "lora_id": None,
        "medium": None,
        "lora_name": None,
    } | fields
    return VllmBlockStoredArray(**values) if encoding == "array" else VllmBlockStoredMap(**values)


def _plain_msgpack(struct: WireEvent) -> Any:
    """The struct as plain msgpack values (a list or a dict), to cut or extend."""
    return msgspec.msgpack.decode(ENCODE(struct))


def _corrupt(struct: WireEvent, **changes: Any) -> WireEvent:
    return msgspec.structs.replace(struct, **changes)


def _batch(*events: Any) -> EventBatch:
    return decode_payload(ENCODE([1.0, list(events), 0]), 7)


def _only(batch: EventBatch) -> Event:
    assert batch.num_bad_events == 0
    (event,) = batch.events
    return event


BAD_EVENTS = [
    pytest.param(["BlockEvicted", [1]], id="array-unknown-tag"),
    pytest.param({"type": "BlockEvicted", "block_hashes": [1]}, id="map-unknown-tag"),
    pytest.param(
        _corrupt(BlockRemovedArray([1], "GPU"), block_hashes="abc"), id="array-hashes-a-string"
    ),
    pytest.param(
        _corrupt(VllmBlockRemovedMap([1], "GPU"), block_hashes="abc"), id="map-hashes-a-string"
    ),
    pytest.param(_corrupt(_stored("array", [1]), token_ids="abc"), id="tokens-a-string"),
    pytest.param(_corrupt(_stored("map", [1]), block_size="16"), id="block-size-a-string"),
    pytest.param(_corrupt(_stored("array", [1]), block_hashes=[1.5]), id="float-hash"),
    pytest.param(_corrupt(_stored("array", [1]), block_hashes=[True]), id="bool-hash"),
    pytest.param(_corrupt(_stored("array", [1]), medium=3), id="medium-an-int"),
    pytest.param(_corrupt(_stored("array", [1]), extra_keys=["salt"]), id="extra-key-not-a-tuple"),
    pytest.param(_plain_msgpack(_stored("array", [1]))[:4], id="array-missing-required"),
    pytest.param(
        {k: v for k, v in _plain_msgpack(_stored("map", [1])).items() if k != "type"},
        id="map-without-tag",
    ),
    pytest.param([], id="empty-array"),
    pytest.param("BlockStored", id="a-string"),
    pytest.param(None, id="nil"),
]


@pytest.mark.parametrize("bad", BAD_EVENTS)
def test_bad_event_is_skipped_and_counted_batch_survives(bad: Any) -> None:
    batch = _batch(VllmBlockRemovedMap([11], "GPU"), bad, AllBlocksClearedArray())
    assert batch.num_bad_events == 1
    assert batch.events == (BlockRemoved((11,), Tier.GPU), AllBlocksCleared())
    assert (batch.seq, batch.ts, batch.rank) == (7, 1.0, 0)


def test_fields_kvindex_does_not_read_are_ignored_whatever_they_hold() -> None:
    plain = _stored("map", [5], block_size=16, token_ids=list(range(16)))
    event = _plain_msgpack(plain) | {"ownership": {"any": 1}, "future_field": {"nested": [1, 2]}}
    event["kv_cache_spec_kind"] = ["not", "a", "string"]
    assert _only(_batch(event)) == _only(_batch(plain))


def test_extra_trailing_array_elements_are_ignored() -> None:
    plain = _stored("array", [5], medium="CPU", group_idx=0)
    longer = [*_plain_msgpack(plain), "LOCAL", "owner", "session", [[1, 2]], "from-vllm-0.99"]
    assert _only(_batch(longer)) == _only(_batch(plain))
    removed = [*_plain_msgpack(BlockRemovedArray([5], "CPU", 0)), "LOCAL", "owner", 42]
    assert _only(_batch(removed)) == BlockRemoved((5,), Tier.CPU, 0)


@pytest.mark.parametrize(
    "event",
    [
        pytest.param(BlockStoredArray([9], None, [1, 2], 2, None), id="array-vllm-0.9"),
        pytest.param(
            {
                k: v
                for k, v in _plain_msgpack(
                    _stored("map", [9], token_ids=[1, 2], block_size=2)
                ).items()
                if k not in ("medium", "lora_name")
            },
            id="map-without-medium-or-lora-name",
        ),
    ],
)
def test_trailing_optional_stored_fields_may_be_absent(event: Any) -> None:
    expected = BlockStored((9,), None, [1, 2], 2, Tier.GPU, None, None, None)
    assert _only(_batch(event)) == expected


@pytest.mark.parametrize(
    "event", [_plain_msgpack(BlockRemovedArray([9]))[:2], BlockRemovedMap([9])]
)
def test_removed_without_medium_is_gpu(event: Any) -> None:
    assert _only(_batch(event)) == BlockRemoved((9,), Tier.GPU, None)


def _required(struct: type[msgspec.Struct]) -> list[str]:
    """The struct's fields without a default (they come first)."""
    fields = struct.__struct_fields__
    return list(fields[: len(fields) - len(struct.__struct_defaults__)])


@pytest.mark.parametrize(
    "struct",
    [_stored("map", [9]), VllmBlockRemovedMap([9], None)],
    ids=["BlockStored", "BlockRemoved"],
)
def test_map_fields_vllm_always_sends_are_written_even_when_none(struct: WireEvent) -> None:
    """vLLM writes ``"lora_id": null`` and leaves out an unset ``extra_keys``: so do we."""
    written = _plain_msgpack(struct)
    assert list(written) == ["type", *_required(type(struct))]
    assert written["medium"] is None


def test_batch_without_rank_is_rank_zero() -> None:
    batch = decode_payload(ENCODE([2.5, [AllBlocksClearedArray()]]), 3)
    assert (batch.seq, batch.ts, batch.rank, batch.events) == (3, 2.5, 0, (AllBlocksCleared(),))


# Values chosen so that msgspec writes every msgpack integer format (checked below).
HASH_WIDTHS = [
    0,
    127,
    128,
    255,
    256,
    65535,
    65536,
    2**32 - 1,
    2**32,
    2**63 - 1,
    2**63,
    2**64 - 1,
    -1,
    -32,
    -33,
    -128,
    -129,
    -(2**15) - 1,
    -(2**31) - 1,
    -(2**63),
]


def test_hash_widths_cover_every_msgpack_int_format() -> None:
    first_bytes = {ENCODE(v)[0] for v in HASH_WIDTHS}
    formats = {0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD1, 0xD2, 0xD3}
    assert formats <= first_bytes
    assert any(b < 0x80 for b in first_bytes)  # positive fixint
    assert any(b >= 0xE0 for b in first_bytes)  # negative fixint


@pytest.mark.parametrize("value", HASH_WIDTHS, ids=str)
@pytest.mark.parametrize("encoding", ["array", "map"])
def test_hash_of_every_int_width_is_unsigned_64(value: int, encoding: Encoding) -> None:
    stored = _only(_batch(_stored(encoding, [value, 1], parent_block_hash=value)))
    removed = _only(_batch(BlockRemovedArray([value])))
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (value % U64, 1)
    assert stored.parent_hash == value % U64
    assert removed == BlockRemoved((value % U64,), Tier.GPU)
    assert 0 <= value % U64 < U64


def test_32_byte_bin_hashes_use_the_last_8_bytes_big_endian() -> None:
    digest = bytes(range(32))
    parent = bytes(range(100, 132))
    stored = _only(_batch(_stored("map", [digest, 7], parent_block_hash=parent)))
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (int.from_bytes(digest[-8:], "big"), 7)
    assert stored.parent_hash == int.from_bytes(parent[-8:], "big")
    assert stored.block_hashes[0] == int.from_bytes(digest, "big") % U64


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        ("GPU", Tier.GPU),
        ("gpu", Tier.GPU),
        ("CPU", Tier.CPU),
        ("cpu", Tier.CPU),
        ("Cpu", Tier.CPU),
        ("STORAGE", Tier.OTHER),
        ("FS", Tier.OTHER),
        ("", Tier.OTHER),
        (None, Tier.GPU),
    ],
)
def test_medium_folds_into_tier(medium: str | None, tier: Tier) -> None:
    stored = _only(_batch(_stored("array", [1], medium=medium)))
    removed = _only(_batch(BlockRemovedArray([1], medium)))
    assert isinstance(stored, BlockStored)
    assert stored.tier is tier
    assert removed == BlockRemoved((1,), tier)


def test_extra_keys_become_one_tuple_or_none_per_block() -> None:
    extra = [("sql-lora", ["9f" * 32, 3]), None, ("tenant-a",)]
    stored = _only(_batch(_stored("map", [1, 2, 3], extra_keys=extra)))
    assert isinstance(stored, BlockStored)
    assert stored.extra_keys == (("sql-lora", ["9f" * 32, 3]), None, ("tenant-a",))


def test_the_sequence_frame_round_trips_and_the_end_marker_is_all_ones() -> None:
    assert encode_seq(END_SEQ) == b"\xff" * 8 and decode_seq(b"\xff" * 8) == END_SEQ
    for seq in (0, 1, 255, 2**53 + 1, 2**63, 2**64 - 2):
        assert decode_seq(encode_seq(seq)) == seq
        assert type(decode_seq(encode_seq(seq))) is int


def test_a_live_message_with_the_end_markers_seq_is_refused() -> None:
    payload = encode_batch([], ts=1.0, rank=0, encoding="map")
    assert decode_live(encode_live(b"kv@r1@m", 2**64 - 2, payload)).batch.seq == 2**64 - 2
    with pytest.raises(WireError, match="end marker"):
        decode_live([b"kv@r1@m", b"\xff" * 8, payload])


@pytest.mark.parametrize(
    "frames",
    [[], [SEQ0], [b"x", SEQ0], [b"", SEQ0, b""]],
    ids=["none", "no-delimiter", "delimiter-not-empty", "three-frames"],
)
def test_a_malformed_replay_request_is_refused(frames: list[bytes]) -> None:
    with pytest.raises(WireError):
        decode_replay_request(frames)


# --- properties -----------------------------------------------------------------------

_hashes = st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(min_size=32, max_size=32))
_names = st.one_of(st.none(), st.text(max_size=8))
_media = st.sampled_from([None, "GPU", "CPU", "cpu", "Cpu", "STORAGE", "gpu"])
_groups = st.one_of(st.none(), st.integers(0, 3))
_extra_key = st.one_of(st.none(), st.lists(st.one_of(st.text(max_size=6), st.integers(0, 99))))


@st.composite
def _stored_fields(draw: st.DrawFn) -> dict[str, Any]:
    hashes = draw(st.lists(_hashes, max_size=4))
    return {
        "block_hashes": hashes,
        "parent_block_hash": draw(st.one_of(st.none(), _hashes)),
        "token_ids": draw(st.lists(st.integers(0, 2**32 - 1), max_size=8)),
        "block_size": draw(st.integers(0, 64)),
        "lora_id": draw(st.one_of(st.none(), st.integers(0, 9))),
        "medium": draw(_media),
        "lora_name": draw(_names),
        "extra_keys": draw(st.one_of(st.none(), st.lists(_extra_key, max_size=4))),
        "group_idx": draw(_groups),
        "kv_cache_spec_kind": draw(st.sampled_from([None, "full_attention", "mamba"])),
    }


@st.composite
def _removed_fields(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "block_hashes": draw(st.lists(_hashes, max_size=4)),
        "medium": draw(_media),
        "group_idx": draw(_groups),
    }


_events: st.SearchStrategy[tuple[str, dict[str, Any]]] = st.one_of(
    st.tuples(st.just("BlockStored"), _stored_fields()),
    st.tuples(st.just("BlockRemoved"), _removed_fields()),
    st.tuples(st.just("AllBlocksCleared"), st.just({})),
)
_STRUCTS: dict[Encoding, dict[str, type[WireEvent]]] = {
    "map": {
        "BlockStored": VllmBlockStoredMap,
        "BlockRemoved": VllmBlockRemovedMap,
        "AllBlocksCleared": AllBlocksClearedMap,
    },
    "array": {
        "BlockStored": VllmBlockStoredArray,
        "BlockRemoved": BlockRemovedArray,
        "AllBlocksCleared": AllBlocksClearedArray,
    },
}


def _struct(encoding: Encoding, tag: str, fields: dict[str, Any]) -> WireEvent:
    return _STRUCTS[encoding][tag](**fields)


@settings(max_examples=200, deadline=None, database=None)
@given(
    events=st.lists(_events, max_size=6),
    ts=st.floats(allow_nan=False),
    rank=st.integers(0, 7),
)
def test_array_and_map_encodings_decode_to_the_same_events(
    events: list[tuple[str, dict[str, Any]]], ts: float, rank: int
) -> None:
    as_arrays = decode_payload(ENCODE([ts, [_struct("array", *e) for e in events], rank]), 1)
    as_maps = decode_payload(ENCODE([ts, [_struct("map", *e) for e in events], rank]), 1)
    assert as_arrays == as_maps
    assert as_arrays.num_bad_events == 0
    assert (as_arrays.ts, as_arrays.rank) == (ts, rank)
    expected = [_expected_view(tag, _plain_fields(fields)) for tag, fields in events]
    assert [_actual_view(e) for e in as_arrays.events] == expected


def _plain_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """Hypothesis fields in payload_decoded's vocabulary (bin hashes as bytes_hex)."""
    plain = dict(fields)
    if "block_hashes" in plain:
        plain["block_hashes"] = _plain(plain["block_hashes"])
    plain["parent_block_hash"] = _plain(plain.get("parent_block_hash"))
    return plain


# Domain events in decoded form: what decode_payload gives, and so what must come back.
_engine_hash = st.integers(0, U64 - 1)
_domain_extra_keys = st.one_of(
    st.none(),
    st.lists(
        st.one_of(
            st.none(),
            st.lists(
                st.one_of(st.text(max_size=6), st.integers(0, 99), st.lists(st.integers(0, 9)))
            ).map(tuple),
        ),
        max_size=4,
    ).map(tuple),
)
_domain_events: st.SearchStrategy[Event] = st.one_of(
    st.builds(
        BlockStored,
        block_hashes=st.lists(_engine_hash, max_size=4).map(tuple),
        parent_hash=st.one_of(st.none(), _engine_hash),
        token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=8),
        block_size=st.integers(0, 64),
        tier=st.sampled_from(Tier),
        lora_name=_names,
        extra_keys=_domain_extra_keys,
        group_idx=_groups,
    ),
    st.builds(
        BlockRemoved,
        block_hashes=st.lists(_engine_hash, max_size=4).map(tuple),
        tier=st.sampled_from(Tier),
        group_idx=_groups,
    ),
    st.just(AllBlocksCleared()),
)


@settings(max_examples=300, deadline=None, database=None)
@given(
    events=st.lists(_domain_events, max_size=6),
    ts=st.floats(allow_nan=False),
    rank=st.integers(0, 7),
    seq=st.integers(0, 2**63),
    encoding=st.sampled_from(["map", "array"]),
)
def test_encoded_events_decode_to_the_same_events(
    events: list[Event], ts: float, rank: int, seq: int, encoding: Encoding
) -> None:
    payload = encode_batch(events, ts=ts, rank=rank, encoding=encoding)
    assert decode_payload(payload, seq) == EventBatch(seq, ts, rank, tuple(events))
    message = decode_live(encode_live(TOPIC, seq, payload))
    assert (message.topic, message.batch.seq) == (TOPIC.decode(), seq)


@settings(max_examples=100, deadline=None, database=None)
@given(
    events=st.lists(_domain_events, min_size=1, max_size=3),
    seq=st.integers(0, 2**63),
    encoding=st.sampled_from(["map", "array"]),
    layout=st.sampled_from(["topic", "legacy"]),
)
def test_encoded_replay_replies_decode_to_the_same_batches(
    events: list[Event], seq: int, encoding: Encoding, layout: ReplayLayout
) -> None:
    payload = encode_batch(events, ts=1.5, rank=0, encoding=encoding)
    frames = encode_replay_reply(seq, payload, topic=TOPIC, layout=layout)
    topic = TOPIC.decode() if layout == "topic" else None
    for reply in (decode_replay([b"", *frames]), decode_replay(frames, delimited=False)):
        assert reply == ReplayReply(seq, EventBatch(seq, 1.5, 0, tuple(events)), topic)
    end = decode_replay([b"", *encode_replay_end(layout)])
    assert end.is_end and end.topic == ("" if layout == "topic" else None)


@settings(max_examples=500, deadline=None, database=None)
@given(payload=st.binary(max_size=200))
def test_arbitrary_payload_bytes_raise_only_wire_error(payload: bytes) -> None:
    with contextlib.suppress(WireError):
        decode_live([TOPIC, SEQ0, payload])


@settings(max_examples=300, deadline=None, database=None)
@given(junk=st.lists(msgpack_values, max_size=4))
def test_arbitrary_events_never_cost_the_batch(junk: list[Any]) -> None:
    batch = _batch(VllmBlockRemovedMap([3], "CPU"), *junk, AllBlocksClearedArray())
    assert batch.events[0] == BlockRemoved((3,), Tier.CPU)
    assert batch.events[-1] == AllBlocksCleared()
    assert len(batch.events) + batch.num_bad_events == len(junk) + 2


@settings(max_examples=300, deadline=None, database=None)
@given(frames=st.lists(st.binary(max_size=24), max_size=5), delimited=st.booleans())
def test_arbitrary_frames_raise_only_wire_error(frames: list[bytes], delimited: bool) -> None:
    with contextlib.suppress(WireError):
        decode_live(frames)
    with contextlib.suppress(WireError):
        decode_replay(frames, delimited=delimited)


def test_payload_shape_reads_encoding_and_hash_form() -> None:
    stored = BlockStored((1, 2), None, tuple(range(32)), 16, Tier.GPU)
    assert payload_shape(encode_batch([stored], ts=0.0, rank=0, encoding="map")) == ("map", "int")
    array = encode_batch([stored], ts=0.0, rank=0, encoding="array")
    assert payload_shape(array) == ("array", "int")
    digests = msgspec.msgpack.encode(EventBatchMap(0.0, [BlockStoredMap([b"\x01" * 32])]))
    assert payload_shape(digests) == ("map", "bytes")
    removed_only = encode_batch([BlockRemoved((1,), Tier.GPU)], ts=0.0, rank=0, encoding="map")
    assert payload_shape(removed_only) == ("unknown", "unknown")
    assert payload_shape(b"\xc1") == ("unknown", "unknown")
    assert payload_shape(msgspec.msgpack.encode([0.0, [], 0])) == ("unknown", "unknown")
