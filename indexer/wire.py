"""vLLM's KV-event wire format (``--kv-events-config``), decoded once at the edge.

Live message: ``[topic, seq (8 bytes big-endian), payload]``. Payload: msgpack array
``[ts, events, data_parallel_rank]``. Events are msgpack arrays tagged by their first
element (vLLM ≤ 0.23) or maps tagged by key ``"type"`` (vLLM ≥ 0.24); trailing optional
fields may be absent and unknown extra fields are ignored. Hashes arrive as any msgpack
int width or as a 32-byte bin and are normalised to unsigned 64-bit (the last 8 bytes,
big-endian — vLLM's own int projection).

Replay (DEALER ↔ vLLM's ROUTER): request ``["", start_seq (8 bytes)]``; each reply is
``["", seq, payload]`` (vLLM < 0.26) or ``["", topic, seq, payload]`` (≥ 0.26); the end
marker has an empty payload and seq ``0xFF * 8``. Layouts are told apart by frame count.

Everything here is pure: bytes in, domain objects out, :class:`WireError` on bad input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvindex.indexer.errors import KvIndexError
from kvindex.indexer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
    EventBatch,
    Tier,
)

SEQ_BYTES = 8
END_SEQ = -1
END_SEQ_BYTES = b"\xff" * SEQ_BYTES
_U64 = (1 << 64) - 1
# msgspec raises RecursionError (not DecodeError) for deeply nested input; it is bad data too.
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)

WireHash = int | bytes


class WireError(KvIndexError):
    """A frame or payload that is not vLLM's KV-event format.

    ``seq`` is set when the message's sequence frame was readable (only its payload was
    bad), so the stream can move past that batch instead of asking for it again.
    """

    def __init__(self, message: str, *, seq: int | None = None) -> None:
        super().__init__(message)
        self.seq = seq


# --- msgspec mirrors of vLLM's structs (vllm/distributed/kv_events.py) -------------------


class _StoredMap(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class _RemovedMap(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[WireHash]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedMap(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class _StoredArray(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class _RemovedArray(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: list[WireHash]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedArray(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


_MapEvent = _StoredMap | _RemovedMap | _ClearedMap
_ArrayEvent = _StoredArray | _RemovedArray | _ClearedArray
_WireEvent = _MapEvent | _ArrayEvent


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_BATCH_DECODERS = (msgspec.msgpack.Decoder(_MapBatch), msgspec.msgpack.Decoder(_ArrayBatch))
_RAW_BATCH = msgspec.msgpack.Decoder(_RawBatch)
_EVENT_DECODERS = (msgspec.msgpack.Decoder(_MapEvent), msgspec.msgpack.Decoder(_ArrayEvent))


# --- normalisation ---------------------------------------------------------------------


def normalize_hash(value: WireHash) -> EngineHash:
    """vLLM's int projection: the last 8 bytes big-endian, as unsigned 64-bit.

    Negative ints (Python ``hash()`` before vLLM 0.10.2) are reinterpreted as unsigned.
    """
    if isinstance(value, bytes):
        return int.from_bytes(value[-SEQ_BYTES:], "big")
    return value & _U64


def _hashes(values: list[WireHash]) -> tuple[EngineHash, ...]:
    # Fast path (C loops): non-negative ints are the common case and are already u64.
    try:
        if not values or min(values) >= 0:  # type: ignore[operator]
            return tuple(values)  # type: ignore[arg-type]
    except TypeError:  # bytes among them
        pass
    return tuple(normalize_hash(v) for v in values)


_TIER_OF_MEDIUM = {None: Tier.GPU, "GPU": Tier.GPU, "CPU": Tier.CPU}


def _tier(medium: str | None) -> Tier:
    tier = _TIER_OF_MEDIUM.get(medium)
    return Tier.from_medium(medium) if tier is None else tier


def _to_domain(event: _WireEvent) -> Event:
    kind = type(event)
    if kind is _StoredMap or kind is _StoredArray:
        parent = event.parent_block_hash  # type: ignore[union-attr]
        if parent is not None and (type(parent) is not int or parent < 0):
            parent = normalize_hash(parent)
        extra = event.extra_keys  # type: ignore[union-attr]
        tier = _TIER_OF_MEDIUM.get(event.medium)  # type: ignore[union-attr]
        return BlockStored(
            _hashes(event.block_hashes),  # type: ignore[union-attr]
            parent,
            event.token_ids,  # type: ignore[union-attr]
            event.block_size,  # type: ignore[union-attr]
            _tier(event.medium) if tier is None else tier,  # type: ignore[union-attr]
            event.lora_name,  # type: ignore[union-attr]
            None if extra is None else tuple(extra),
            event.group_idx,  # type: ignore[union-attr]
        )
    if kind is _RemovedMap or kind is _RemovedArray:
        tier = _TIER_OF_MEDIUM.get(event.medium)  # type: ignore[union-attr]
        return BlockRemoved(
            _hashes(event.block_hashes),  # type: ignore[union-attr]
            _tier(event.medium) if tier is None else tier,  # type: ignore[union-attr]
            event.group_idx,  # type: ignore[union-attr]
        )
    return AllBlocksCleared()


# --- payloads and frames ---------------------------------------------------------------


def decode_payload(payload: bytes, seq: int) -> EventBatch:
    """Decode one batch payload. Bad events are skipped and counted in ``num_bad_events``.

    Raises :class:`WireError` only when the batch itself (not one event) is unreadable.
    """
    for decoder in _BATCH_DECODERS:
        try:
            batch = decoder.decode(payload)
        except _DECODE_ERRORS:
            continue
        events = tuple(map(_to_domain, batch.events))
        return EventBatch(seq, batch.ts, batch.data_parallel_rank or 0, events)
    return _decode_leniently(payload, seq)


def _decode_leniently(payload: bytes, seq: int) -> EventBatch:
    """Slow path: decode event by event so that one bad event does not lose the batch."""
    try:
        raw = _RAW_BATCH.decode(payload)
    except _DECODE_ERRORS as exc:
        raise WireError(f"undecodable batch payload (seq {seq}): {exc}", seq=seq) from exc
    events: list[Event] = []
    num_bad = 0
    for item in raw.events:
        event = _decode_event(item)
        if event is None:
            num_bad += 1
        else:
            events.append(event)
    return EventBatch(seq, raw.ts, raw.data_parallel_rank or 0, tuple(events), num_bad)


def _decode_event(raw: msgspec.Raw) -> Event | None:
    for decoder in _EVENT_DECODERS:
        try:
            return _to_domain(decoder.decode(raw))
        except (*_DECODE_ERRORS, TypeError, ValueError):
            continue
    return None


def decode_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence frame; the replay end marker decodes as ``END_SEQ``."""
    if len(frame) != SEQ_BYTES:
        raise WireError(f"sequence frame must be {SEQ_BYTES} bytes, got {len(frame)}")
    if frame == END_SEQ_BYTES:
        return END_SEQ
    return int.from_bytes(frame, "big")


class LiveMessage(msgspec.Struct, frozen=True, gc=False):
    """One live PUB message, decoded (a Struct: one is built per batch on the hot path)."""

    topic: str
    batch: EventBatch


def decode_live(frames: list[bytes]) -> LiveMessage:
    """A live PUB message ``[topic, seq, payload]``."""
    if len(frames) != 3:
        raise WireError(f"live message must have 3 frames, got {len(frames)}")
    topic_frame, seq_frame, payload = frames
    topic = _decode_topic(topic_frame)
    seq = decode_seq(seq_frame)
    return LiveMessage(topic, decode_payload(payload, seq))


def _decode_topic(frame: bytes) -> str:
    try:
        return frame.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError("topic frame is not UTF-8") from exc


# --- replay ----------------------------------------------------------------------------


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to vLLM's replay ROUTER: empty delimiter, then the start seq."""
    return [b"", max(start_seq, 0).to_bytes(SEQ_BYTES, "big")]


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
    """A replay reply, in either layout (told apart by frame count, never by content).

    A DEALER (``delimited``) receives ``["", seq, payload]`` (vLLM < 0.26) or
    ``["", topic, seq, payload]`` (≥ 0.26); a REQ socket strips the empty delimiter.
    The end marker has an empty payload and seq ``0xFF * 8``.
    """
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
