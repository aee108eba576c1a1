"""Request and response bodies of the HTTP API, as msgspec Structs (fast JSON both ways);
the OpenAPI schema is generated from these same types."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import msgspec

from kvindex.api.tokenize.protocol import TokenId

BlockKey = Annotated[int, msgspec.Meta(ge=0)]
"""A block key (unsigned 64-bit; the upper bound is checked by the scorer, since msgspec
constraints stop at int64)."""


MAX_TOKEN_IDS = 1 << 20
"""Most ``token_ids`` in one ``/score`` request (past any model's context; 422 above)."""
MAX_BLOCK_KEYS = MAX_TOKEN_IDS // 16
"""Most ``block_keys`` in one ``/score`` request (as many blocks as MAX_TOKEN_IDS make in
vLLM's default block size; 422 above)."""
MAX_CANDIDATES = 1024
"""Most ``candidates`` in one ``/score`` request (422 above)."""
ALL_CANDIDATES = 0
"""``top_k`` value asking for an entry per candidate."""


class ScoreRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where should this request go? Give exactly one of token_ids, prompt, messages,
    block_keys."""

    model: str
    token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOKEN_IDS)] | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    """OpenAI chat messages: the whole conversation (rendered with the model's template)."""
    block_keys: Annotated[list[BlockKey], msgspec.Meta(max_length=MAX_BLOCK_KEYS)] | None = None
    """Keys precomputed with ``kvindex.indexer.domain.keys.block_keys`` (the router skips
    tokenization)."""
    block_size: int | None = None
    """The block size the keys (or tokens) were meant for; a mismatch with the model's is a
    422 instead of a silent miss."""
    lora_name: str | None = None
    cache_salt: str | None = None
    session: str | None = None
    """Session key for the ``session_affinity`` policy."""
    workload: str | None = None
    """The request's workload, for ``[[rules]]`` (default: the ``x-kvindex-workload``
    header)."""
    user: str | None = None
    """Who sends the request (an OpenAI body's ``user``), for ``[[rules]]``."""
    has_tools: bool = False
    """The request offers tools (an OpenAI body's ``tools``), for ``[[rules]]``."""
    candidates: Annotated[list[str], msgspec.Meta(max_length=MAX_CANDIDATES)] | None = None
    """Replica ids to choose from (default: every replica serving the model)."""
    policy: str | None = None
    weights: dict[str, float] | None = None
    """Per-request overrides of scoring weights (names as in ``GET /config``)."""
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """Entries in the answer's ``scores``: the best ``top_k`` candidates (``0``: every
    candidate; default: the API's ``default_top_k``). ``best`` is the same whatever it is."""
    dry_run: bool = False
    """Ask without routing: the answer changes nothing (it is not counted as load, the
    round-robin turn does not advance, random draws leave the seeded sequence alone)."""


_RAW_NULL = msgspec.Raw(b"null")


def _raw_tokens_request() -> type[msgspec.Struct]:
    """:class:`ScoreRequest` with ``token_ids`` kept as the raw JSON (every other field, its
    type and constraints, the same)."""
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

_json_token_ids: Callable[[object, int], bytes | None] | None = None
"""The compiled JSON token-array reader (None: not built, every body decodes in full)."""
_json_token_span: Callable[[object, int], tuple[bytes, int, int] | None] | None = None
"""The compiled finder of a body's ``"token_ids": [...]`` (None: not built)."""
try:
    from kvindex.indexer.native import _lookup
except ImportError:
    pass
else:
    _json_token_ids, _json_token_span = _lookup.json_token_ids, _lookup.json_token_span

_MARKER = b'"kvindex:token_ids"'
"""Put where a body's token array was: the decode then reads it back as ``token_ids``
only if that array was the object's own field (a body holding it is read otherwise)."""
_MARKER_RAW = msgspec.Raw(_MARKER)


def decode_score_request(body: bytes) -> tuple[ScoreRequest, bytes | None]:
    """A ``POST /score`` body as its request, and its ``token_ids`` as little-endian u32
    bytes (what the block keys hash) when they were read that way: the request's
    ``token_ids`` is then None."""
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
    """The request and its packed ids when the first ``"token_ids": [...]`` of the body is
    its own field, read without the decoder walking the array (it gets the body with
    :data:`_MARKER` in the array's place, and must read the marker back as ``token_ids``);
    None: the body is to be read otherwise."""
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
    """The request of a decoded :data:`_RAW_TOKENS_DECODER` body, without its ``token_ids``."""
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
    """Answers with this replica as ``best`` since the load was stored, by every API
    process sharing the load store (counted as load: ``weights.routed`` each)."""


class FreshnessView(msgspec.Struct):
    state: str
    """``live``, ``replaying`` or ``stale``."""
    lag_s: float | None
    """How far behind the engine the last applied batch was received."""
    silent_s: float | None
    """Seconds since anything was heard from the replica."""


class ScoreEntry(msgspec.Struct):
    replica: str
    rank: int
    """Data-parallel rank holding the longest match."""
    matched_blocks: int
    matched_tokens: int
    tiers: dict[str, int]
    """Matched blocks by tier (gpu, cpu, other)."""
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
    """The best candidates, best first (as many as the request's ``top_k`` asks)."""
    num_candidates: int
    """Candidates scored, in ``scores`` or not."""
    num_matched: int
    """Candidates holding at least the prompt's first block, in ``scores`` or not."""
    degraded: str | None = None
    """Set when the answer was made without the index (e.g. Redis down: load only), or on
    the last fleet state known (the fleet's store unreadable, or it lost the fleet), or
    when every candidate is unhealthy (all of them are then ranked)."""
    unhealthy: dict[str, str] = {}
    """Candidates left out of the ranking while another one is healthy, and why (ejected by
    health checks or a breaker; events stream down)."""
    rule: str | None = None
    """Name of the ``[[rules]]`` entry that chose the policy and weights (the first that
    matched); None when no rule matched."""


class LoadReport(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /load``: a replica or router reports a replica's load."""

    replica: str
    running: float
    waiting: float
    kv_usage: float = 0.0
    ts: float | None = None
    """When measured (unix seconds); default: now."""


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
    """Tokens per block in the stream's events (None until a store with tokens is seen)."""
    block_size_mismatch: bool = False
    """The stream's block size is not its model's (``[[models]]`` ``block_size``, else the
    fleet's most common): its blocks can never match a request."""
    owner: str | None = None
    """The sharded indexer keeping the stream (its ``indexer_id``); None: not sharded."""


class HealthView(msgspec.Struct):
    """A replica's health record as an operator reads it (``GET /replicas``)."""

    state: str
    """``healthy`` or ``ejected``."""
    detail: str
    """``healthy``, or why it is ejected (failed health checks, an open breaker)."""
    check_failures: int
    """Consecutive failed health checks."""
    check_successes: int
    """Consecutive passed health checks."""
    checked_s_ago: float | None
    """Seconds since its last health check ended (None: never checked)."""
    breaker: str
    """``closed``, ``open`` or ``half-open``."""
    last_error: str | None
    num_ejections: int


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
    """Its health checks and breaker (None: never judged)."""


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
    """Resident blocks by tier (gpu, cpu, other)."""
    batches: int
    gaps: int
    replays: int
    restarts: int
    decode_errors: int


class ModelView(msgspec.Struct):
    block_size: int
    """Tokens per block: configured, else as the model's replicas publish it."""


class ConfigView(msgspec.Struct):
    """``GET /config``: what a request gets unless it says otherwise."""

    default_policy: str
    weights: dict[str, float]
    models: dict[str, ModelView]
    rules: list[dict[str, Any]] = []
    """The ``[[rules]]``, in the order they are tried (the first match wins), each as its
    table: ``name``, the conditions it gives, ``policy`` and/or ``weights``."""
