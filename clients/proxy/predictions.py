"""Predictions held against the engines' answers: the index's matched tokens on the chosen
replica against the ``usage`` it reports (``prompt_tokens_details.cached_tokens``), classified
by :func:`outcome_of` (the rule: :meth:`Prediction.expected_cached`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

OUTCOMES = ("exact", "over_predicted", "under_predicted", "token_mismatch", "unreported")
"""``outcome`` of ``kvindex_proxy_predictions_total`` (docs/guides/proxy.md says each)."""
MAX_BODY_BYTES = 1 << 20
"""A whole answer read for its ``usage`` at most this long (longer: ``unreported``)."""


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _Answer(msgspec.Struct):
    # An answer or a stream chunk: only ``usage`` is read (every other field skipped).
    usage: _Usage | None = None


_decode = msgspec.json.Decoder(_Answer).decode


@dataclass(frozen=True, slots=True)
class Truth:
    prompt_tokens: int
    cached_tokens: int


def truth_of(body: bytes) -> Truth | None:
    """The ``usage`` of a JSON answer or chunk (None: absent, partial, or not JSON)."""
    try:
        usage = _decode(body).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if usage is None or usage.prompt_tokens is None or usage.prompt_tokens_details is None:
        return None
    cached = usage.prompt_tokens_details.cached_tokens
    return None if cached is None else Truth(usage.prompt_tokens, cached)


@dataclass(frozen=True, slots=True)
class Prediction:
    replica: str
    model: str
    num_tokens: int  # the router's count of the prompt's tokens
    matched_tokens: int  # the index's matched blocks on ``replica`` times the block size
    block_size: int

    def expected_cached(self, prompt_tokens: int) -> int:
        """The cached tokens an engine agreeing with the index reports (whole blocks only,
        never the last prompt token: at most ``(prompt_tokens - 1) // block_size`` blocks)."""
        cap = max(0, prompt_tokens - 1) // self.block_size * self.block_size
        return min(self.matched_tokens, cap)


def outcome_of(prediction: Prediction, truth: Truth | None) -> tuple[str, int | None]:
    """The outcome and the error in tokens, expected minus cached (None: not compared); a
    token-count mismatch first: with another prompt the blocks cannot be compared."""
    if truth is None:
        return "unreported", None
    if truth.prompt_tokens != prediction.num_tokens:
        return "token_mismatch", None
    error = prediction.expected_cached(truth.prompt_tokens) - truth.cached_tokens
    if error == 0:
        return "exact", 0
    return ("over_predicted" if error > 0 else "under_predicted"), error


@dataclass(slots=True)
class Accuracy:
    counts: dict[str, int]

    def view(self) -> dict[str, object]:
        """``GET /replicas``' ``predictions``: the counts and the exact share of the compared."""
        compared = sum(n for o, n in self.counts.items() if o != "unreported")
        ratio = None if not compared else round(self.counts.get("exact", 0) / compared, 4)
        return {"accuracy": ratio, **{o: self.counts.get(o, 0) for o in OUTCOMES}}


Observer = Callable[[Prediction, str, int | None], None]
Judge = Callable[[Prediction, "Truth | None", str], None]


class Predictions:
    """Every request's outcome, counted per replica, told to ``judge``; thread-safe."""

    def __init__(
        self, observe: Observer = lambda _p, _o, _e: None, judge: Judge | None = None
    ) -> None:
        self._observe = observe
        self._judge = judge
        self._lock = threading.Lock()
        self._replica_to_counts: dict[str, dict[str, int]] = {}

    def record(self, prediction: Prediction, truth: Truth | None) -> str:
        """Classify one finished request, count it, and return its outcome."""
        outcome, error = outcome_of(prediction, truth)
        with self._lock:
            counts = self._replica_to_counts.setdefault(prediction.replica, {})
            counts[outcome] = counts.get(outcome, 0) + 1
        self._observe(prediction, outcome, error)
        if self._judge is not None:
            self._judge(prediction, truth, outcome)
        return outcome

    def accuracy(self) -> dict[str, Accuracy]:
        with self._lock:
            return {r: Accuracy(dict(c)) for r, c in self._replica_to_counts.items()}


_USAGE_KEY = b'"usage"'
_EVENT_END = b"\n\n"
_DATA = b"data:"


class StreamTruth:
    """Reads a server-sent-events answer for its usage chunk, dropped from what the client gets
    when ``hide`` (the proxy asked for it, the client did not). Chunks pass through untouched
    but for a tail ending mid-event, held until the next chunk."""

    def __init__(self, *, hide: bool) -> None:
        self.hide = hide
        self.truth: Truth | None = None
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        """What of ``chunk`` goes on to the client now."""
        if self._held:
            chunk, self._held = self._held + chunk, b""
        if not chunk.endswith(_EVENT_END):
            cut = chunk.rfind(_EVENT_END) + len(_EVENT_END) if _EVENT_END in chunk else 0
            chunk, self._held = chunk[:cut], chunk[cut:]
        if _USAGE_KEY not in chunk:
            return chunk
        return self._events(chunk)

    def end(self) -> bytes:
        """What is still held when the answer ends (an event without its blank line)."""
        held, self._held = self._held, b""
        if held and _USAGE_KEY in held:
            return self._events(held)
        return held

    def _events(self, chunk: bytes) -> bytes:
        kept = []
        for event in chunk.split(_EVENT_END):
            data = event.strip()
            if data.startswith(_DATA) and _USAGE_KEY in data:
                truth = truth_of(data[len(_DATA) :])
                if truth is not None:
                    self.truth = truth
                    if self.hide:
                        continue
            kept.append(event)
        return _EVENT_END.join(kept)


class BodyTruth:
    """Keeps a whole (non-streamed) answer's chunks, at most :data:`MAX_BODY_BYTES`, to read
    its ``usage`` once it has all come; the chunks themselves pass on unchanged."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._num_bytes = 0

    def feed(self, chunk: bytes) -> bytes:
        self._num_bytes += len(chunk)
        if self._num_bytes <= MAX_BODY_BYTES:
            self._chunks.append(chunk)
        return chunk

    def end(self) -> bytes:
        return b""

    @property
    def truth(self) -> Truth | None:
        if not self._chunks or self._num_bytes > MAX_BODY_BYTES:
            return None
        body = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        return truth_of(body)


AnswerTruth = StreamTruth | BodyTruth


def with_usage_asked(body: bytes, decoded: Mapping[str, Any]) -> bytes | None:
    """``body`` (``decoded``: a JSON object with ``"stream": true``) asking for the usage chunk
    (None: the client did); the rest of the body unchanged unless ``stream_options`` was set."""
    options = decoded.get("stream_options", _ABSENT)
    if options is _ABSENT:
        start = body.index(b"{") + 1
        comma = b"" if body[start:].lstrip().startswith(b"}") else b","
        return body[:start] + b'"stream_options":{"include_usage":true}' + comma + body[start:]
    if isinstance(options, dict) and options.get("include_usage") is True:
        return None
    kept = options if isinstance(options, dict) else {}
    return msgspec.json.encode({**decoded, "stream_options": {**kept, "include_usage": True}})


_ABSENT = object()
