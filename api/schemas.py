"""The HTTP API's request and response bodies as msgspec Structs; the OpenAPI schema is
generated from them, and a body they reject is a 422."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import msgspec

from kvindex.api.tokenize.protocol import TokenId

BlockKey = Annotated[int, msgspec.Meta(ge=0)]
"""Unsigned 64-bit (the scorer checks the upper bound: msgspec constraints stop at int64)."""


# Most ids, keys (MAX_TOKEN_IDS in blocks of vLLM's default 16) and candidates per request.
MAX_TOKEN_IDS = 1 << 20
MAX_BLOCK_KEYS = MAX_TOKEN_IDS // 16
MAX_CANDIDATES = 1024
ALL_CANDIDATES = 0
"""``top_k`` value asking for an entry per candidate."""


class ScoreRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where should this request go? Give exactly one of token_ids, prompt, messages, block_keys."""

    model: str
    token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOKEN_IDS)] | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    """With ``messages``, as are the next four: what else of a chat request its template
    renders (vLLM's chat completion fields of the same names)."""
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    block_keys: Annotated[list[BlockKey], msgspec.Meta(max_length=MAX_BLOCK_KEYS)] | None = None
    """Keys precomputed with ``kvindex.indexer.domain.keys.block_keys`` (no tokenization)."""
    block_size: int | None = None
    """The block size the keys were meant for; a mismatch is a 422, not a silent miss."""
    lora_name: str | None = None
    cache_salt: str | None = None
    session: str | None = None
    workload: str | None = None
    """For ``[[rules]]``, as are the next two (default: the ``x-kvindex-workload`` header)."""
    user: str | None = None
    has_tools: bool = False
    candidates: Annotated[list[str], msgspec.Meta(max_length=MAX_CANDIDATES)] | None = None
    """Default: every replica serving the model."""
    policy: str | None = None
    weights: dict[str, float] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """Entries in ``scores`` (0: every candidate; default: ``default_top_k``); ``best`` is not."""
    dry_run: bool = False
    """Ask without routing: no load counted, no round-robin turn, no seeded draw used."""


_RAW_NULL = msgspec.Raw(b"null")


def _raw_tokens_request() -> type[msgspec.Struct]:
    """:class:`ScoreRequest` with ``token_ids`` kept as raw JSON."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = [
        (f.name, f.type)
        if f.required
        else (f.name, msgspec.Raw, _RAW_NULL)
        if f.name == "token_ids"
        else (f.name, f.type, f.default)
        for f in msgspec.structs.fields(ScoreRequest)
    ]
    return msgspec.defstruct(
        "ScoreRequestRawTokens", fields, kw_only=True, forbid_unknown_fields=True
    )


_RAW_TOKENS_DECODER = msgspec.json.Decoder(_raw_tokens_request())
_REQUEST_DECODER = msgspec.json.Decoder(ScoreRequest)

# The compiled token-array reader and finder (None: not built, every body decodes in full).
_json_token_ids: Callable[[object, int], bytes | None] | None = None
_json_token_span: Callable[[object, int], tuple[bytes, int, int] | None] | None = None
try:
    from kvindex.indexer.native import _lookup
except ImportError:
    pass
else:
    _json_token_ids, _json_token_span = _lookup.json_token_ids, _lookup.json_token_span

_MARKER = b'"kvindex:token_ids"'
"""Put in place of a body's token array: read back as ``token_ids`` only if it was its own."""
_MARKER_RAW = msgspec.Raw(_MARKER)


def decode_score_request(body: bytes) -> tuple[ScoreRequest, bytes | None]:
    """The request, and its ``token_ids`` as little-endian u32 bytes if read that way (then the
    request's is None); msgspec's errors for a bad body (one nested too deep too:
    :func:`nested_too_deep`), a ValidationError for chat options that exclude each other."""
    try:
        request, packed = _score_request_of(body)
    except RecursionError:
        raise nested_too_deep() from None
    chat = request.messages is not None
    if chat and request.continue_final_message and request.add_generation_prompt:
        raise msgspec.ValidationError(
            "continue_final_message and add_generation_prompt cannot both be true"
            " (add_generation_prompt defaults to true: set it to false)"
        )
    return request, packed


def nested_too_deep() -> msgspec.DecodeError:
    """What a body nested past msgspec's depth guard (its RecursionError) is answered with."""
    return msgspec.DecodeError("JSON malformed: nested too deeply")


def _score_request_of(body: bytes) -> tuple[ScoreRequest, bytes | None]:
    spliced = _spliced(body)
    if spliced is not None:
        return spliced
    read = _json_token_ids
    if read is not None:
        try:
            raw = _RAW_TOKENS_DECODER.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError):
            raw = None
        if raw is not None and (tokens := raw.token_ids) != _RAW_NULL:  # type: ignore[attr-defined]
            packed = read(tokens, MAX_TOKEN_IDS)
            if packed is not None:
                return _request_of(raw), packed
    return _REQUEST_DECODER.decode(body), None


def _spliced(body: bytes) -> tuple[ScoreRequest, bytes] | None:
    """The request and packed ids, the array read apart from the body (None: read otherwise)."""
    span = _json_token_span
    found = span(body, MAX_TOKEN_IDS) if span is not None else None
    if found is None:
        return None
    packed, start, end = found
    head, tail = body[:start], body[end:]
    spliced = b"".join((head, _MARKER, tail))
    # The marker read back must be the one put in: the only one of the spliced body (the
    # array held none, having no quote; so this is ``_MARKER not in body`` without a scan
    # of the array's bytes).
    if spliced.count(_MARKER) != 1:
        return None
    try:
        raw = _RAW_TOKENS_DECODER.decode(spliced)
        if raw.token_ids != _MARKER_RAW:  # type: ignore[attr-defined]  # a field of the struct made
            return None
        # The array was the object's own field: with ``null`` in its place the body is the
        # one just decoded but for that field, and decodes straight to the request (a
        # fraction of what copying the decoded fields over costs, :func:`_request_of`).
        request = _REQUEST_DECODER.decode(b"".join((head, b"null", tail)))
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return request, packed


def _request_of(raw: msgspec.Struct) -> ScoreRequest:
    fields = msgspec.structs.asdict(raw)
    del fields["token_ids"]
    return ScoreRequest(**fields)


class LoadView(msgspec.Struct):
    running: float
    waiting: float
    kv_usage: float
    age_s: float
    source: str
    routed: int = 0
    """Answers naming it ``best`` since the load was stored, over every API process."""


class FreshnessView(msgspec.Struct, omit_defaults=True):
    state: str
    """``live``, ``partial``, ``replaying``, ``stale`` or ``orphaned``."""
    lag_s: float | None
    silent_s: float | None
    partial: str | None = None
    """Why the index may lack blocks the replica holds (absent: its view is whole)."""
    partial_since: float | None = None
    """Since when (Unix time)."""


class ScoreEntry(msgspec.Struct):
    replica: str
    rank: int
    matched_blocks: int
    matched_tokens: int
    tiers: dict[str, int]
    load: LoadView | None
    freshness: FreshnessView
    terms: dict[str, float]
    score: float


class ScoreResponse(msgspec.Struct):
    model: str
    block_size: int
    num_tokens: int
    num_blocks: int
    best: str | None
    policy: str
    weights: dict[str, float]
    scores: list[ScoreEntry]
    """Best first, as many as ``top_k`` asks; the counts below are over every candidate."""
    num_candidates: int
    num_matched: int
    degraded: str | None = None
    """Why the answer is degraded: no index, the last fleet state known, or none healthy."""
    unhealthy: dict[str, str] = {}
    """Candidates left out of the ranking while another one is healthy, and why."""
    rule: str | None = None
    """The ``[[rules]]`` entry that matched first (None: none)."""


class LoadReport(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /load``: a replica or router reports a replica's load."""

    replica: str
    running: float
    waiting: float
    kv_usage: float = 0.0
    ts: float | None = None


class ReplicaIn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /replicas``: register (or update) a replica at run time."""

    id: str
    model: str
    events: str | None = None
    replay: str | None = None
    url: str | None = None
    dp_size: int = 1


class StreamView(msgspec.Struct):
    rank: int
    freshness: FreshnessView
    connected: bool
    last_seq: int
    blocks: dict[str, int]
    counters: dict[str, int]
    block_size: int | None = None
    block_size_mismatch: bool = False
    """Not its model's block size: its blocks can never match a request."""
    owner: str | None = None
    """The sharded indexer keeping the stream (None: not sharded)."""


class HealthView(msgspec.Struct):
    """A replica's health record as an operator reads it (``GET /replicas``)."""

    state: str
    """``healthy`` or ``ejected``; ``detail`` says why."""
    detail: str
    check_failures: int
    check_successes: int
    checked_s_ago: float | None
    breaker: str
    """``closed``, ``open`` or ``half-open``."""
    last_error: str | None
    num_ejections: int


class VerdictView(msgspec.Struct):
    """What the proxy concluded of a replica's predictions (``docs/guides/proxy.md``)."""

    distrusted: bool
    """Its cache term discounted now (over-predictions persisted)."""
    num_verdicts: int = 0
    under_predicted: dict[str, int] = {}


class PredictionsView(msgspec.Struct):
    """A proxy's predictions held against one replica's answers: each outcome's count, and
    ``accuracy``, the exact share of those compared (None: none compared yet)."""

    accuracy: float | None
    exact: int = 0
    over_predicted: int = 0
    under_predicted: int = 0
    token_mismatch: int = 0
    unreported: int = 0
    verdict: VerdictView | None = None


class ReplicaView(msgspec.Struct):
    id: str
    model: str
    events: str | None
    replay: str | None
    url: str | None
    dp_size: int
    state: str
    """Worst freshness over its streams."""
    streams: list[StreamView]
    load: LoadView | None
    health: HealthView | None = None
    predictions: PredictionsView | None = None
    """Only from a proxy (``kvindex proxy``'s ``/replicas``): the API makes no predictions."""


class ErrorBody(msgspec.Struct):
    error: str
    detail: str


class StatusBody(msgspec.Struct, omit_defaults=True):
    """The answer of a call that changes something: what happened (and to which replica)."""

    status: str
    id: str | None = None


class StatsView(msgspec.Struct):
    """``GET /stats``: totals over every replica and stream."""

    replicas: int
    streams: int
    blocks: dict[str, int]
    batches: int
    gaps: int
    replays: int
    restarts: int
    decode_errors: int


class ModelView(msgspec.Struct):
    block_size: int


class ConfigView(msgspec.Struct):
    """``GET /config``: what a request gets unless it says otherwise."""

    default_policy: str
    weights: dict[str, float]
    models: dict[str, ModelView]
    rules: list[dict[str, Any]] = []
    """The ``[[rules]]`` tables in the order they are tried."""
