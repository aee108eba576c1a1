"""Reference: kvindex.indexer.ingest.wire.decode_raw_batch; tests/unit/indexer/ingest/test_batch_walker.py::test_the_walker_reads_what_msgspec_reads
A batch read without recursion (Python, bounded in size), for one nested past msgspec's depth:
only the deep event is lost."""  # noqa: E501

from __future__ import annotations

import msgspec

MAX_WALKED_BYTES = 1 << 20
"""Largest payload :func:`walk_batch` walks; a larger one nested that deep is undecodable."""
_SCALAR_SIZES = {
    **dict.fromkeys((0xC0, 0xC2, 0xC3), 0),
    **{0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8},
    **{0xCA: 4, 0xCB: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17},
}
"""msgpack heads followed by a fixed number of bytes (nil, bools, numbers, fixext)."""
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC7: 1, 0xC8: 2, 0xC9: 4}
"""bin, str and ext heads: how many bytes give the length (ext adds a type byte)."""
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}
"""array and map heads: bytes of the count, items per counted element."""


def _head(buf: bytes, pos: int) -> tuple[int, int]:
    head = buf[pos]
    pos += 1
    if head < 0x80 or head >= 0xE0:  # fixint
        return pos, 0
    if head < 0xA0:  # fixmap, fixarray
        return pos, (head & 0x0F) * (2 if head < 0x90 else 1)
    if head < 0xC0:  # fixstr
        return pos + (head & 0x1F), 0
    if head in _SCALAR_SIZES:
        return pos + _SCALAR_SIZES[head], 0
    if head in _SIZED:
        width = _SIZED[head]
        extra = 1 if head in (0xC7, 0xC8, 0xC9) else 0
        return pos + width + extra + int.from_bytes(buf[pos : pos + width], "big"), 0
    if head in _CONTAINERS:
        width, per = _CONTAINERS[head]
        return pos + width, per * int.from_bytes(buf[pos : pos + width], "big")
    raise ValueError(f"invalid msgpack head {head:#x}")


def _skip(buf: bytes, pos: int) -> int:
    remaining = 1
    while remaining:
        pos, items = _head(buf, pos)
        remaining += items - 1
    if pos > len(buf):
        raise ValueError("truncated")
    return pos


def _items(buf: bytes, pos: int) -> list[bytes]:
    if not (0x90 <= buf[pos] <= 0x9F or buf[pos] in (0xDC, 0xDD)):
        raise ValueError("not an array")
    pos, count = _head(buf, pos)
    found = []
    for _ in range(count):
        end = _skip(buf, pos)
        found.append(buf[pos:end])
        pos = end
    return found


def walk_batch(payload: bytes) -> tuple[float, list[msgspec.Raw], int | None]:
    """``(ts, raw events, rank)``; ValueError, IndexError or msgspec's errors for a bad batch."""
    if len(payload) > MAX_WALKED_BYTES or _skip(payload, 0) != len(payload):
        raise ValueError("too large to walk, or trailing bytes")
    fields = _items(payload, 0)
    if len(fields) not in (2, 3):
        raise ValueError("a batch is [ts, events, data_parallel_rank]")
    ts = msgspec.msgpack.decode(fields[0], type=float)
    events = [msgspec.Raw(item) for item in _items(fields[1], 0)]
    rank = msgspec.msgpack.decode(fields[2], type=int | None) if len(fields) == 3 else None
    return ts, events, rank
