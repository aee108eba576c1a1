"""A journal export (JSON lines, or ``GET /decisions``' array) as a trace: each receipt at its
time with the ids it kept, the rest of its prompt ids of its own; receipts without ids skipped."""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvindex.clients.proxy.receipt import Receipt, unpacked_ids
from kvindex.clients.workloads.log_trace import DEFAULT_OUTPUT_TOKENS
from kvindex.clients.workloads.trace import TraceRequest, WorkloadError, trace_tokens

_decode_line = msgspec.json.Decoder(Receipt).decode
_decode_array = msgspec.json.Decoder(list[Receipt]).decode
_MARKER = b'"receipt"'


@dataclass(frozen=True, slots=True)
class JournalTrace:
    requests: list[TraceRequest]
    num_skipped: int  # receipts without token ids (or tokens), not replayed
    block_sizes: frozenset[int]  # what the receipts were routed with


def is_journal(path: Path) -> bool:
    """``path`` holds receipts (its first line or its array's first object has ``receipt``)."""
    try:
        with path.open("rb") as file:
            head = file.read(4096)
    except OSError:
        return False
    return head.lstrip()[:1] in (b"{", b"[") and _MARKER in head


def read_journal(path: Path, *, limit: int | None = None) -> JournalTrace:
    """The export's receipts as requests, sorted by arrival (the first at 0 s)."""
    receipts = _receipts(path)[:limit]
    usable = [r for r in receipts if r.token_ids is not None and r.num_tokens > 0]
    if not usable:
        raise WorkloadError(
            f"{path}: none of its {len(receipts)} receipts keeps token ids; the proxy keeps"
            " them with proxy.journal_token_bytes > 0 (off by default: they are the prompt)"
        )
    first = min(r.time for r in usable)
    requests = sorted((_request(path, r, r.time - first) for r in usable), key=_arrival)
    sizes = frozenset(r.block_size for r in usable)
    return JournalTrace(requests, len(receipts) - len(usable), sizes)


def _arrival(request: TraceRequest) -> float:
    return request.arrival_s


def _receipts(path: Path) -> list[Receipt]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise WorkloadError(f"{path}: {exc}") from exc
    try:
        if data.lstrip()[:1] == b"[":
            return _decode_array(data)
        lines = [(n, line) for n, line in enumerate(data.split(b"\n"), 1) if line.strip()]
    except msgspec.DecodeError as exc:
        raise WorkloadError(f"{path}: not a journal export: {exc}") from exc
    receipts = []
    for number, line in lines:
        try:
            receipts.append(_decode_line(line))
        except msgspec.DecodeError as exc:
            raise WorkloadError(f"{path}:{number}: not a receipt: {exc}") from exc
    return receipts


def _request(path: Path, receipt: Receipt, arrival_s: float) -> TraceRequest:
    assert receipt.token_ids is not None
    try:
        kept = unpacked_ids(receipt.token_ids)
    except ValueError as exc:
        raise WorkloadError(f"{path}: receipt {receipt.id!r}: {exc}") from exc
    prompt = array("I", kept[: receipt.num_tokens])
    missing = receipt.num_tokens - len(prompt)
    if missing > 0:  # a start no other request has: blocks of this request's own
        first = int.from_bytes(hashlib.blake2b(receipt.id.encode(), digest_size=6).digest()) << 16
        prompt.extend(trace_tokens(range(first, first + missing // 512 + 1), missing))
    output = receipt.max_tokens if receipt.max_tokens is not None else DEFAULT_OUTPUT_TOKENS
    return TraceRequest(arrival_s, len(prompt), output, receipt.session, prompt)
