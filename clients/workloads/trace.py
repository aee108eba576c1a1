"""Requests as a router sees them (:class:`TraceRequest`), and Mooncake traces read into them."""

from __future__ import annotations

import gzip
import hashlib
import itertools
import math
import random
import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated

import msgspec

from kvindex.indexer.domain.errors import KvIndexError

TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in Mooncake traces."""


class WorkloadError(KvIndexError):
    """A trace that cannot be read (names the line) or a bad generator setting."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request; its prompt is ``prompt`` if given, else synthesized from ``hash_ids``."""

    arrival_s: float
    input_length: int
    output_length: int
    session: str | None = None
    prompt: Sequence[int] | None = None
    hash_ids: Sequence[int] = ()
    output: Sequence[int] | None = None
    """The answer's tokens, when a later request repeats them (None: never cached)."""

    def tokens(self) -> list[int]:
        if self.prompt is not None:
            return list(self.prompt)
        return trace_tokens(self.hash_ids, self.input_length)


def poisson_arrivals(rng: random.Random, rate: float) -> Iterator[float]:
    """Arrival times (s) from 0, Poisson at ``rate`` requests/s."""
    t = 0.0
    while True:
        yield t
        t += rng.expovariate(rate)


def block_tokens(block_id: int, num_tokens: int = TRACE_BLOCK_TOKENS) -> list[int]:
    """Deterministic tokens of one trace block: the first ``num_tokens`` of its 512."""
    digest = hashlib.shake_128(b"kvindex-sim/" + block_id.to_bytes(8, "little")).digest(
        2 * num_tokens
    )
    words = array("H", digest)
    if sys.byteorder != "little":
        words.byteswap()
    return words.tolist()


def trace_tokens(hash_ids: Sequence[int], input_length: int) -> list[int]:
    """A trace request's prompt: its blocks' tokens, the last one cut to ``input_length``."""
    out: list[int] = []
    for i, block_id in enumerate(hash_ids):
        n = min(TRACE_BLOCK_TOKENS, input_length - i * TRACE_BLOCK_TOKENS)
        if n <= 0:
            break
        out += block_tokens(block_id, n)
    return out


def read_trace(path: Path, *, limit: int | None = None) -> list[TraceRequest]:
    """A Mooncake JSONL trace (plain or gzip), sorted by arrival, with derived sessions."""
    requests: list[TraceRequest] = []
    for lineno, line in _rows(path):
        requests.append(_trace_request(path, lineno, line))
        if limit is not None and len(requests) >= limit:
            break
    if not requests:
        raise WorkloadError(f"{path}: no requests")
    requests.sort(key=lambda r: r.arrival_s)
    sessions = trace_sessions([r.hash_ids for r in requests])
    return [replace(r, session=s) for r, s in zip(requests, sessions, strict=True)]


SHARED_MIN_FANOUT = 4
"""A block followed by this many different blocks (and SHARED_MIN_SHARE) is shared."""
SHARED_MIN_SHARE = 0.01


def trace_sessions(hash_ids_of: Sequence[Sequence[int]]) -> list[str]:
    """A session per request: the first block after its shared prefix (``b<id>``)."""
    threshold = max(SHARED_MIN_FANOUT, math.ceil(SHARED_MIN_SHARE * len(hash_ids_of)))
    shared = _shared_blocks(hash_ids_of, threshold)
    sessions = []
    for ids in hash_ids_of:
        depth = 0
        for position, block in enumerate(ids):
            if block in shared:
                depth = position + 1
        sessions.append(f"b{ids[min(depth, len(ids) - 1)]}")
    return sessions


def _shared_blocks(hash_ids_of: Sequence[Sequence[int]], threshold: int) -> set[int]:
    """Blocks followed by at least ``threshold`` different next blocks."""
    first_next: dict[int, int] = {}
    more_next: dict[int, set[int]] = {}
    for ids in hash_ids_of:
        for block, following in itertools.pairwise(ids):
            seen = first_next.setdefault(block, following)
            if seen == following:
                continue
            others = more_next.setdefault(block, {seen})
            if len(others) < threshold:
                others.add(following)
    return {block for block, others in more_next.items() if len(others) >= threshold}


class _MooncakeRow(msgspec.Struct):
    timestamp: Annotated[float, msgspec.Meta(ge=0)]
    input_length: Annotated[int, msgspec.Meta(ge=1)]
    output_length: Annotated[int, msgspec.Meta(ge=0)]
    hash_ids: list[Annotated[int, msgspec.Meta(ge=0)]]


_decode_row = msgspec.json.Decoder(_MooncakeRow).decode


def _rows(path: Path) -> Iterator[tuple[int, str]]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as lines:
            for lineno, line in enumerate(lines, 1):
                if line.strip():
                    yield lineno, line
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"{path}: {exc}") from exc


def _trace_request(path: Path, lineno: int, line: str) -> TraceRequest:
    where = f"{path}:{lineno}"
    try:
        row = _decode_row(line)
    except msgspec.DecodeError as exc:
        raise WorkloadError(f"{where}: {exc}") from exc
    covered = len(row.hash_ids) * TRACE_BLOCK_TOKENS
    if covered < row.input_length:
        raise WorkloadError(
            f"{where}: {len(row.hash_ids)} hash_ids cover {covered} tokens,"
            f" fewer than input_length {row.input_length}"
        )
    return TraceRequest(
        row.timestamp / 1000.0,
        row.input_length,
        row.output_length,
        hash_ids=tuple(row.hash_ids),
    )
