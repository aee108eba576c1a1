"""vLLM's KV-event wire format (``--kv-events-config``), both directions; pure, and the only
module that reads msgpack (:class:`WireError` on bad input).

Live: ``[topic, seq (8 bytes big-endian), payload]``, payload ``[ts, events, rank]``; events
are arrays tagged first (vLLM ≤ 0.23) or maps tagged by ``"type"`` (≥ 0.24). Hashes of any
int width or 32-byte bins become u64 (the last 8 bytes, big-endian: vLLM's projection).
Replay: request ``["", start_seq]``; replies ``["", seq, payload]`` (< 0.26) or ``["",
topic, seq, payload]``, told apart by frame count; the end has seq ``0xFF * 8``, no payload.

Per event type a base Struct holds what kvindex reads (decoding); its ``Vllm*`` subclass is
vLLM's whole struct (encoding, byte for byte as vLLM writes it, checked against captures).
SGLang (≥ 0.5) sends the same frames and map events, with ``cache_salt`` and no
``extra_keys``: those stores get the extra keys vLLM would have sent for the request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeAlias

import msgspec

from kvindex.indexer import native
from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
    EventBatch,
    Tier,
)
from kvindex.indexer.ingest.batch_walker import walk_batch

if TYPE_CHECKING:
    from kvindex.indexer.native._core import NativeBatch

SEQ_BYTES = 8
END_SEQ = -1
END_SEQ_BYTES = b"\xff" * SEQ_BYTES
_U64 = (1 << 64) - 1
# msgspec raises RecursionError (not DecodeError) for deeply nested input; it is bad data too.
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)

Encoding = Literal["map", "array"]
ReplayLayout = Literal["topic", "legacy"]
WireHash: TypeAlias = int | bytes
WireExtraKeys: TypeAlias = list[tuple[Any, ...] | None] | None


class WireError(KvIndexError):
    """A frame or payload that is not vLLM's KV-event format; ``seq`` is set when only the
    payload was bad, so the stream can move past that batch."""

    def __init__(self, message: str, *, seq: int | None = None) -> None:
        super().__init__(message)
        self.seq = seq


# --- msgspec mirrors of vLLM's structs (vllm/distributed/kv_events.py) -------------------
# The base Structs are what the indexer decodes: kvindex's fields only (msgspec skips the
# others without building them), every field that vLLM versions or producers may leave out
# defaulted (SGLang's ``cache_salt`` only in the map store's). Their ``Vllm*`` subclasses are
# what is encoded: vLLM encodes map events with
# ``omit_defaults``, so a field vLLM declares without a default is always written
# (``"lora_id": null``) and a defaulted one only when set; the subclasses declare those
# fields without a default again, and add vLLM's fields that kvindex never reads. Array
# events are positional: every field is written, trailing extra ones are ignored.


class _StoredMapFields(msgspec.Struct, tag="BlockStored", gc=False):
    """The ``BlockStored`` map fields vLLM ≥ 0.24 and SGLang share, as the indexer reads them."""

    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: WireExtraKeys = None
    group_idx: int | None = None


class BlockStoredMap(_StoredMapFields, tag="BlockStored"):
    """A map ``BlockStored`` as the indexer reads it: vLLM ≥ 0.24's, or SGLang's."""

    cache_salt: str | None = None


class VllmBlockStoredMap(_StoredMapFields, omit_defaults=True):
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemovedMap(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[WireHash]
    medium: str | None = None
    group_idx: int | None = None


class VllmBlockRemovedMap(BlockRemovedMap, omit_defaults=True):
    medium: str | None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksClearedMap(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    """vLLM ≥ 0.24's ``AllBlocksCleared`` (no field: one Struct both ways)."""


class BlockStoredArray(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    """vLLM ≤ 0.23's ``BlockStored`` as the indexer reads it (vLLM 0.9 sent five fields)."""

    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: WireExtraKeys = None
    group_idx: int | None = None
    cache_salt: ClassVar[str | None] = None  # only map events carry it (SGLang's)


class VllmBlockStoredArray(BlockStoredArray):
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemovedArray(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: list[WireHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksClearedArray(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    """vLLM ≤ 0.23's ``AllBlocksCleared`` (no field: one Struct both ways)."""


MapEvent: TypeAlias = BlockStoredMap | BlockRemovedMap | AllBlocksClearedMap
ArrayEvent: TypeAlias = BlockStoredArray | BlockRemovedArray | AllBlocksClearedArray
VllmMapEvent: TypeAlias = VllmBlockStoredMap | VllmBlockRemovedMap | AllBlocksClearedMap
WireEvent: TypeAlias = MapEvent | ArrayEvent | VllmBlockStoredMap
VllmArrayEvent: TypeAlias = VllmBlockStoredArray | BlockRemovedArray | AllBlocksClearedArray


class EventBatchMap(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[MapEvent]
    data_parallel_rank: int | None = None


class VllmEventBatchMap(msgspec.Struct, array_like=True, gc=False):  # what encode_batch writes
    ts: float
    events: list[VllmMapEvent]
    data_parallel_rank: int | None = None


class EventBatchArray(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[ArrayEvent]
    data_parallel_rank: int | None = None


class RawBatch(msgspec.Struct, array_like=True, gc=False):
    """A batch with its events left as msgpack bytes (read one by one when one is bad)."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


def _with_raw_tokens(base: type[msgspec.Struct], tag: str) -> type[msgspec.Struct]:
    """``base`` with its token ids left as msgpack bytes for the core to pack (derived, so
    never written twice)."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for info in msgspec.structs.fields(base):
        if info.name == "token_ids" and info.default_factory is list:
            fields.append((info.name, msgspec.Raw, msgspec.Raw(b"\x90")))  # omitted: ``[]``
        elif info.name == "token_ids":
            fields.append((info.name, msgspec.Raw))
        elif info.default is not msgspec.NODEFAULT:
            fields.append((info.name, info.type, info.default))
        elif info.default_factory is not msgspec.NODEFAULT:
            factory = msgspec.field(default_factory=info.default_factory)
            fields.append((info.name, info.type, factory))
        else:
            fields.append((info.name, info.type))
    config = base.__struct_config__
    names = {info.name for info in msgspec.structs.fields(base)}
    namespace = {} if "cache_salt" in names else {"cache_salt": None}
    return msgspec.defstruct(
        f"_Raw{base.__name__}",
        fields,
        tag=tag,
        array_like=config.array_like,
        gc=False,
        namespace=namespace,
    )


_encoder = msgspec.msgpack.Encoder()
_BATCH_DECODERS = (
    msgspec.msgpack.Decoder(EventBatchMap),
    msgspec.msgpack.Decoder(EventBatchArray),
)
_RAW_BATCH = msgspec.msgpack.Decoder(RawBatch)
_RawStoredMap = _with_raw_tokens(BlockStoredMap, "BlockStored")
_RawStoredArray = _with_raw_tokens(BlockStoredArray, "BlockStored")


def _fast_batch_decoder(name: str, event: object) -> msgspec.msgpack.Decoder[Any]:
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = [
        ("ts", float),
        ("events", list[event]),  # type: ignore[valid-type]
        ("data_parallel_rank", int | None, None),
    ]
    batch = msgspec.defstruct(name, fields, array_like=True, gc=False)
    return msgspec.msgpack.Decoder(batch)


_FAST_BATCH_DECODERS = (
    _fast_batch_decoder("_FastBatchMap", _RawStoredMap | BlockRemovedMap | AllBlocksClearedMap),
    _fast_batch_decoder(
        "_FastBatchArray", _RawStoredArray | BlockRemovedArray | AllBlocksClearedArray
    ),
)
"""The packed path: the batches with stores' token ids left raw, packed by the core."""
_STORED_KINDS = frozenset((BlockStoredMap, BlockStoredArray, _RawStoredMap, _RawStoredArray))
_EVENT_DECODERS = (msgspec.msgpack.Decoder(MapEvent), msgspec.msgpack.Decoder(ArrayEvent))


# --- decoding: wire structs → domain events ----------------------------------------------


def normalize_hash(value: WireHash) -> EngineHash:
    """vLLM's int projection: the last 8 bytes big-endian; negative ints as unsigned."""
    if isinstance(value, bytes):
        return int.from_bytes(value[-SEQ_BYTES:], "big")
    return value & _U64


_unsigned = native.unsigned_hashes


def _hashes(values: list[WireHash]) -> tuple[EngineHash, ...]:
    unsigned = _unsigned(values)  # compiled: a list of u64 ints, the common case, as they are
    return _general_hashes(values) if unsigned is None else unsigned


def _general_hashes(values: list[WireHash]) -> tuple[EngineHash, ...]:
    try:
        if not values or min(values) >= 0:  # type: ignore[operator]
            return tuple(values)  # type: ignore[arg-type]
    except TypeError:  # bytes among them
        pass
    return tuple(normalize_hash(v) for v in values)


# vLLM's media and SGLang's host memory; the others (DISK, STORAGE...) by name.
_TIER_OF_MEDIUM = {None: Tier.GPU, "GPU": Tier.GPU, "CPU": Tier.CPU, "CPU_PINNED": Tier.CPU}


def _tier(medium: str | None) -> Tier:
    tier = _TIER_OF_MEDIUM.get(medium)
    return Tier.from_medium(medium) if tier is None else tier


def _to_domain(event: WireEvent) -> Event:
    # One function with the lookups inlined: it runs for every event on the hot path.
    kind = type(event)
    if kind in _STORED_KINDS:
        parent = event.parent_block_hash  # type: ignore[union-attr]
        if parent is not None and (type(parent) is not int or parent < 0):
            parent = normalize_hash(parent)
        extra = event.extra_keys  # type: ignore[union-attr]
        if extra is None and event.cache_salt is not None:  # type: ignore[union-attr]
            extra = salted_extra_keys(event)  # type: ignore[arg-type]
        tier = _TIER_OF_MEDIUM.get(event.medium)  # type: ignore[union-attr]
        tokens = event.token_ids  # type: ignore[union-attr]
        if type(tokens) is _Raw:
            tokens = _pack(tokens)
            if tokens is None:
                raise _NotPackedError
        return BlockStored(
            _hashes(event.block_hashes),  # type: ignore[union-attr]
            parent,
            tokens,
            event.block_size,  # type: ignore[union-attr]
            _tier(event.medium) if tier is None else tier,  # type: ignore[union-attr]
            event.lora_name,  # type: ignore[union-attr]
            None if extra is None else tuple(extra),
            event.group_idx,  # type: ignore[union-attr]
        )
    if kind is BlockRemovedMap or kind is BlockRemovedArray:
        tier = _TIER_OF_MEDIUM.get(event.medium)  # type: ignore[union-attr]
        return BlockRemoved(
            _hashes(event.block_hashes),  # type: ignore[union-attr]
            _tier(event.medium) if tier is None else tier,  # type: ignore[union-attr]
            event.group_idx,  # type: ignore[union-attr]
        )
    return AllBlocksCleared()


def salted_extra_keys(event: BlockStoredMap) -> WireExtraKeys:
    """An SGLang store's extra keys as vLLM sends them: the LoRA name on every block, the
    salt on the request's first (no parent); None when no block has any."""
    num_blocks = len(event.block_hashes)
    lora, salt = event.lora_name, event.cache_salt
    first: tuple[Any, ...] = (lora,) if lora is not None else ()
    if salt is not None and event.parent_block_hash is None:
        first = (*first, salt)
    if not first or not num_blocks:
        return None
    rest: tuple[Any, ...] | None = None if lora is None else (lora,)
    return [first, *[rest] * (num_blocks - 1)]


class _NotPackedError(Exception):
    """Token ids the core does not pack: the batch is decoded the general way."""


_Raw = msgspec.Raw
_pack = native.packed_tokens


def decode_payload(payload: bytes, seq: int) -> EventBatch:
    """One batch payload; bad events are skipped and counted, :class:`WireError` only for an
    unreadable batch. Token ids are ``native.PackedTokens`` when the core packs them."""
    batch = _decode_packed(payload, seq)
    return _decode_general(payload, seq) if batch is None else batch


def _decode_packed(payload: bytes, seq: int) -> EventBatch | None:
    """Reference: kvindex.indexer.ingest.wire._decode_general; tests/unit/indexer/native/test_core.py::test_packed_decoding_agrees_with_the_general_one
    The same batch with token ids packed; None unless every event is well formed, with
    packable token ids."""  # noqa: E501
    for decoder in _FAST_BATCH_DECODERS:
        try:
            batch = decoder.decode(payload)
        except _DECODE_ERRORS:
            continue
        try:
            events = tuple(map(_to_domain, batch.events))
        except _NotPackedError:
            return None
        return EventBatch(seq, batch.ts, batch.data_parallel_rank or 0, events)
    return None


def _decode_general(payload: bytes, seq: int) -> EventBatch:
    for decoder in _BATCH_DECODERS:
        try:
            batch = decoder.decode(payload)
        except _DECODE_ERRORS:
            continue
        events = tuple(map(_to_domain, batch.events))
        return EventBatch(seq, batch.ts, batch.data_parallel_rank or 0, events)
    return _decode_leniently(payload, seq)


def _decode_leniently(payload: bytes, seq: int) -> EventBatch:
    """Event by event, so that one bad event does not lose the batch."""
    try:
        raw_batch = decode_raw_batch(payload)
    except RecursionError as exc:
        # An item nested deeper than msgspec recurses: find the events without recursion,
        # so that only the deep one is lost.
        try:
            raw_batch = RawBatch(*walk_batch(payload))
        except (*_DECODE_ERRORS, ValueError, IndexError) as walk_exc:
            message = f"undecodable batch payload (seq {seq}): {exc}: {walk_exc}"
            raise WireError(message, seq=seq) from walk_exc
    except _DECODE_ERRORS as exc:
        raise WireError(f"undecodable batch payload (seq {seq}): {exc}", seq=seq) from exc
    events: list[Event] = []
    num_bad = 0
    for item in raw_batch.events:
        event = _decode_event(item)
        if event is None:
            num_bad += 1
        else:
            events.append(event)
    rank = raw_batch.data_parallel_rank or 0
    return EventBatch(seq, raw_batch.ts, rank, tuple(events), num_bad)


def decode_raw_batch(payload: bytes) -> RawBatch:
    """The batch with its events raw; raises msgspec's errors (``RecursionError`` when
    nested past its depth)."""
    return _RAW_BATCH.decode(payload)


def _decode_event(item: msgspec.Raw) -> Event | None:
    for decoder in _EVENT_DECODERS:
        try:
            return _to_domain(decoder.decode(item))
        except (*_DECODE_ERRORS, TypeError, ValueError):
            continue
    return None


def payload_shape(payload: bytes) -> tuple[str, str]:
    """A payload's encoding (``map`` / ``array``) and hash form (``int`` / ``bytes``), from
    its first readable store; ``unknown`` otherwise. Never raises."""
    try:
        raw_batch = decode_raw_batch(payload)
    except _DECODE_ERRORS:
        return "unknown", "unknown"
    map_decoder, array_decoder = _EVENT_DECODERS
    for item in raw_batch.events:
        for encoding, decode in (("map", map_decoder.decode), ("array", array_decoder.decode)):
            try:
                event: WireEvent = decode(item)
            except _DECODE_ERRORS:
                continue
            if isinstance(event, BlockStoredMap | BlockStoredArray):
                return encoding, _hash_form(event.block_hashes)
    return "unknown", "unknown"


_VLLM_ONLY = frozenset(("extra_keys", "group_idx", "kv_cache_spec_kind", "locality"))
_SGLANG_MEDIA = frozenset(("CPU_PINNED", "DISK", "EXTERNAL"))


def payload_producer(payload: bytes) -> str:
    """``SGLang``, ``vLLM`` or ``unknown``: whose publisher wrote a payload, told from its
    first store (SGLang's fields, signed hashes, media). Never raises."""
    try:
        raw_batch = decode_raw_batch(payload)
        events = [msgspec.msgpack.decode(item) for item in raw_batch.events]
    except (*_DECODE_ERRORS, TypeError):
        return "unknown"
    for event in events:
        if isinstance(event, list) and event[:1] == ["BlockStored"]:
            return "vLLM"  # SGLang sends maps only
        if isinstance(event, dict) and event.get("type") == "BlockStored":
            return "SGLang" if _sglang_store(event) else "vLLM"
    return "unknown"


def _sglang_store(event: dict[Any, Any]) -> bool:
    # vLLM's map stores always carry lora_name; SGLang's omit it when None.
    if "cache_salt" in event or event.get("medium") in _SGLANG_MEDIA:
        return True
    hashes = event.get("block_hashes")
    if isinstance(hashes, list) and any(isinstance(h, int) and h < 0 for h in hashes):
        return True
    return "lora_name" not in event and not _VLLM_ONLY.intersection(event)


def _hash_form(hashes: list[WireHash]) -> str:
    if not hashes:
        return "unknown"
    return "bytes" if isinstance(hashes[0], bytes) else "int"


# --- encoding: domain events → wire structs → bytes ------------------------------------

_MEDIUM_OF_TIER = {Tier.GPU: "GPU", Tier.CPU: "CPU", Tier.OTHER: "STORAGE"}
_StoredFields: TypeAlias = tuple[
    list[WireHash],
    WireHash | None,
    list[int],
    int,
    int | None,
    str,
    str | None,
    WireExtraKeys,
    int | None,
]


def _spec_kind(event: BlockStored) -> str | None:
    # A plain model has one full-attention group; vLLM's CPU placeholders name none.
    return None if event.is_placeholder else "full_attention"


def _stored_fields(event: BlockStored) -> _StoredFields:
    extra_keys = event.extra_keys
    return (
        list(event.block_hashes),
        event.parent_hash,
        list(event.token_ids),
        event.block_size,
        None if event.lora_name is None else 1,  # kvindex keeps the name; vLLM ids start at 1
        _MEDIUM_OF_TIER[event.tier],
        event.lora_name,
        None if extra_keys is None else list(extra_keys),
        event.group_idx,
    )


def _locality(tier: Tier) -> str | None:
    return "LOCAL" if tier is Tier.CPU else None


def _to_map(event: Event) -> VllmMapEvent:
    if isinstance(event, BlockStored):
        return VllmBlockStoredMap(
            *_stored_fields(event),
            kv_cache_spec_kind=_spec_kind(event),
            locality=_locality(event.tier),
        )
    if isinstance(event, BlockRemoved):
        hashes: list[WireHash] = list(event.block_hashes)
        medium = _MEDIUM_OF_TIER[event.tier]
        return VllmBlockRemovedMap(hashes, medium, event.group_idx, _locality(event.tier))
    return AllBlocksClearedMap()


def _to_array(event: Event) -> VllmArrayEvent:
    if isinstance(event, BlockStored):
        return VllmBlockStoredArray(*_stored_fields(event), kv_cache_spec_kind=_spec_kind(event))
    if isinstance(event, BlockRemoved):
        medium = _MEDIUM_OF_TIER[event.tier]
        return BlockRemovedArray(list(event.block_hashes), medium, event.group_idx)
    return AllBlocksClearedArray()


def to_wire(event: Event, encoding: Encoding) -> VllmMapEvent | VllmArrayEvent:
    """The struct vLLM would send for a domain event, what the event does not keep filled
    in as vLLM fills it for a plain model; decoding it gives the (decoded-form) event back."""
    return _to_map(event) if encoding == "map" else _to_array(event)


def encode_batch(events: Sequence[Event], *, ts: float, rank: int, encoding: Encoding) -> bytes:
    """One batch payload as vLLM encodes it: the inverse of :func:`decode_payload`."""
    if encoding == "array":
        return _encoder.encode(EventBatchArray(ts, [_to_array(e) for e in events], rank))
    return _encoder.encode(VllmEventBatchMap(ts, [_to_map(e) for e in events], rank))


# --- frames ----------------------------------------------------------------------------


def encode_seq(seq: int) -> bytes:
    if seq == END_SEQ:
        return END_SEQ_BYTES
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int:
    """The sequence frame (the end marker's as ``END_SEQ``); another length: :class:`WireError`."""
    if len(frame) != SEQ_BYTES:
        raise WireError(f"sequence frame must be {SEQ_BYTES} bytes, got {len(frame)}")
    if frame == END_SEQ_BYTES:
        return END_SEQ
    return int.from_bytes(frame, "big")


class LiveMessage(msgspec.Struct, frozen=True, gc=False):
    topic: str
    batch: EventBatch


def encode_live(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    return [topic, encode_seq(seq), payload]


def decode_live(frames: list[bytes]) -> LiveMessage:
    """A live PUB message; the end marker's seq is refused (:class:`WireError`)."""
    if len(frames) != 3:
        raise WireError(f"live message must have 3 frames, got {len(frames)}")
    topic_frame, seq_frame, payload = frames
    topic = _decode_topic(topic_frame)
    seq = decode_seq(seq_frame)
    if seq == END_SEQ:
        raise WireError("live seq 0xFF * 8 is the replay end marker's, never a batch's")
    return LiveMessage(topic, decode_payload(payload, seq))


def decode_live_native(frames: list[bytes]) -> NativeBatch | None:
    """A live message as a ``native.NativeBatch`` for the compiled ingest path; None for
    anything unusual, which the caller then decodes with :func:`decode_live`."""
    return _native_live(frames)


_native_live = native.native_live


def _decode_topic(frame: bytes) -> str:
    try:
        return frame.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError("topic frame is not UTF-8") from exc


# --- replay ----------------------------------------------------------------------------


def encode_replay_request(start_seq: int) -> list[bytes]:
    return [b"", max(start_seq, 0).to_bytes(SEQ_BYTES, "big")]


def decode_replay_request(frames: list[bytes]) -> int:
    """The start seq of a request as vLLM's ROUTER reads it; else :class:`WireError`."""
    if len(frames) != 2 or frames[0] != b"":
        raise WireError(f"replay request must be an empty delimiter and a seq: {frames!r}")
    return int.from_bytes(frames[1], "big")


def encode_replay_reply(
    seq: int, payload: bytes, *, topic: bytes, layout: ReplayLayout
) -> list[bytes]:
    if layout == "topic":
        return [topic, encode_seq(seq), payload]
    return [encode_seq(seq), payload]


def encode_replay_end(layout: ReplayLayout) -> list[bytes]:
    return encode_replay_reply(END_SEQ, b"", topic=b"", layout=layout)


@dataclass(frozen=True, slots=True)
class ReplayReply:
    """One replay message. ``batch is None`` marks the end of the replay."""

    seq: int
    batch: EventBatch | None
    topic: str | None = None

    @property
    def is_end(self) -> bool:
        return self.batch is None


def decode_replay(frames: list[bytes], *, delimited: bool = True) -> ReplayReply:
    """A replay reply in either layout; ``delimited``: a DEALER's, with the empty frame."""
    if delimited:
        if not frames or frames[0] != b"":
            raise WireError("replay reply must start with an empty delimiter frame")
        frames = frames[1:]
    if len(frames) == 2:
        topic = None
        seq_frame, payload = frames
    elif len(frames) == 3:
        topic = _decode_topic(frames[0])
        seq_frame, payload = frames[1], frames[2]
    else:
        raise WireError(f"replay reply must have 2 or 3 frames after the delimiter: {len(frames)}")
    seq = decode_seq(seq_frame)
    if payload == b"" or seq == END_SEQ:
        return ReplayReply(END_SEQ, None, topic)
    return ReplayReply(seq, decode_payload(payload, seq), topic)
