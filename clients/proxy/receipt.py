"""A route's receipt: one routed request as the proxy's journal keeps it (``GET
/decisions/{id}``, ``kvindex why``, ``kvindex simulate --requests``), and its JSON."""

from __future__ import annotations

import base64
from collections.abc import Sequence

import msgspec

from kvindex.api.schemas import ScoreEntry

RECEIPT_VERSION = 1


class Receipt(msgspec.Struct, kw_only=True):
    """One routed request, as ``GET /decisions/{id}`` shows it (times: Unix s, and ms)."""

    receipt: int = RECEIPT_VERSION
    id: str
    time: float
    route: str
    model: str
    num_tokens: int  # the router's count (0: not tokenized)
    block_size: int
    num_blocks: int
    policy: str
    weights: dict[str, float]
    rule: str | None = None
    degraded: str | None = None
    unhealthy: dict[str, str] = {}
    num_candidates: int
    candidates: list[ScoreEntry]
    """The best first, at most ``proxy.journal_candidates``, as ``/score`` explains them."""
    chosen: str | None
    fallbacks: list[str] = []
    answered_by: str | None = None
    retries: int | None = None
    predicted_tokens: int | None = None  # the index's matched tokens on the replica
    prompt_tokens: int | None = None  # the engine's usage
    cached_tokens: int | None = None
    outcome: str | None = None
    """The prediction's outcome (``kvindex_proxy_predictions_total``; None: not compared)."""
    error_tokens: int | None = None
    status: int
    ttfb_ms: float | None = None
    duration_ms: float
    untokenized: bool = False
    head: bool = False
    """Chosen on the prompt's head; ``num_tokens`` is its estimate until the whole is counted."""
    max_tokens: int | None = None
    session: str | None = None  # a digest of x-kvindex-session or user, not the value
    token_ids: str | None = None
    """The prompt's leading ids, base64 of little-endian u32 (``proxy.journal_token_bytes``)."""


encode_receipt = msgspec.json.Encoder().encode
decode_receipt = msgspec.json.Decoder(Receipt).decode


def packed_ids(ids: Sequence[int]) -> str:
    """Token ids (each a u32) as a receipt keeps them: base64 of little-endian u32."""
    return base64.b64encode(b"".join(i.to_bytes(4, "little") for i in ids)).decode("ascii")


def unpacked_ids(text: str) -> list[int]:
    data = base64.b64decode(text, validate=True)
    if len(data) % 4:
        raise ValueError("token_ids: not a whole number of u32")
    return [int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data), 4)]
