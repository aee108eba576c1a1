"""What ``kvindex check-hash`` runs: prove on a live replica that kvindex's keys match its own.
The ``BlockStored`` events of one unique random prompt (live or replayed) are compared block by
block with what kvindex computes: block size, token ids, parent chain, extra keys, and the keys
through the indexer's own path. :func:`compare` is pure; :func:`run_check` does the I/O."""

from __future__ import annotations

import json
import random
import secrets
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx
import zmq

from kvindex.indexer.domain.errors import KvIndexError, SettingsError
from kvindex.indexer.domain.events import BlockStored, EventBatch, StreamId
from kvindex.indexer.domain.keys import block_keys, request_extra_keys
from kvindex.indexer.fleet.replica import check_endpoint
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.ingest.ingestor import Ingestor
from kvindex.indexer.ingest.replay import ReplayTimeoutError, fetch_replay
from kvindex.indexer.ingest.wire import WireError, decode_live, payload_producer, payload_shape

PromptMode = Literal["tokens", "text"]
_WARMUP_TOKENS = 257
"""Throwaway prompt length: at least one full block for any block size up to 256."""
_TOKEN_RANGE = (1_000, 30_000)
"""Random token ids come from here: inside every real vocabulary, away from specials."""
_HINT = "is --kv-events-config enabled and is --enable-prefix-caching on?"
_STREAM = StreamId("check-hash", 0)


class CheckHashError(KvIndexError):
    """The check could not run (replica unreachable, refused the request, bad answer)."""


# --- what was observed ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ObservedBatch:
    """One batch's ``BlockStored`` events and how they looked on the wire."""

    seq: int
    events: tuple[BlockStored, ...]
    encoding: str = "map"
    """``map`` (vLLM ≥ 0.24), ``array`` (≤ 0.23), or ``unknown`` (replayed batches)."""
    hash_form: str = "int"
    """``int`` or ``bytes`` (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), or ``unknown``."""
    source: str = "live"
    producer: str = "vLLM"  # or SGLang, unknown: wire.payload_producer


# --- the comparison (pure) ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Expected:
    """What kvindex computes from the request alone."""

    model: str
    tokens: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class Mismatch:
    check: str
    """``events``, ``block_size``, ``token_ids``, ``chain``, ``extra_keys`` or ``keys``."""
    message: str


@dataclass(slots=True)
class CheckReport:
    """The outcome; ``ok`` when there is no mismatch. Stable JSON via :meth:`to_json`."""

    ok: bool
    num_blocks: int = 0
    block_size: int | None = None
    expected_block_size: int = 0
    num_prompt_tokens: int = 0
    hash_forms: list[str] = field(default_factory=list)
    encodings: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    producers: list[str] = field(default_factory=list)
    lora_name: str | None = None
    cache_salt: str | None = None
    mismatches: list[Mismatch] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def render(self) -> str:
        if self.ok:
            extras = f"lora {self.lora_name or '-'}, salt {self.cache_salt or '-'}"
            return (
                f"check-hash OK: {self.num_blocks} blocks checked, block size "
                f"{self.block_size}, hash form {'/'.join(self.hash_forms)}, encoding "
                f"{'/'.join(self.encodings)}, producer {'/'.join(self.producers)} "
                f"({'/'.join(self.sources)} events; {extras}); "
                "kvindex keys agree with the replica's BlockStored events"
            )
        lines = [f"check-hash FAILED: {self.mismatches[0].message}"]
        lines += [f"  also: {m.message}" for m in self.mismatches[1:]]
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class _Block:
    """One stored block of the prompt as the events describe it."""

    index: int
    engine_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[object, ...]


@dataclass(frozen=True, slots=True)
class _PromptEvent:
    first_block: int
    event: BlockStored
    batch: ObservedBatch


def prompt_events(tokens: Sequence[int], batches: Sequence[ObservedBatch]) -> list[_PromptEvent]:
    """Stores whose first block is a full block of ``tokens`` (at a block boundary, in the
    event's own block size), one per first block, in prompt order."""
    found: dict[int, _PromptEvent] = {}
    for batch in batches:
        for event in batch.events:
            first = _first_block_in(tokens, event)
            if first is not None and first not in found:
                found[first] = _PromptEvent(first, event, batch)
    return [found[i] for i in sorted(found)]


def _first_block_in(tokens: Sequence[int], event: BlockStored) -> int | None:
    size = event.block_size
    if size <= 0 or len(event.token_ids) < size or event.group_idx not in (None, 0):
        return None
    head = list(event.token_ids[:size])
    for index in range(len(tokens) // size):
        if list(tokens[index * size : (index + 1) * size]) == head:
            return index
    return None


def _event_extras(event: BlockStored, num_blocks: int) -> list[tuple[object, ...]]:
    """Per-block extra keys as the indexer reads them: published, else the LoRA name."""
    if event.extra_keys is not None:
        extras = [tuple(e) if e else () for e in event.extra_keys]
        return extras + [()] * (num_blocks - len(extras))
    if event.lora_name is not None:
        return [(event.lora_name,)] * num_blocks
    return [()] * num_blocks


def _blocks(tokens: Sequence[int], found: list[_PromptEvent]) -> list[_Block]:
    """The prompt's blocks 0, 1, ... covered by events without a hole (later ones dropped)."""
    by_index: dict[int, _Block] = {}
    for item in found:
        event, size = item.event, item.event.block_size
        num_full = len(tokens) // size
        extras = _event_extras(event, len(event.block_hashes))
        parent = event.parent_hash
        for i, engine_hash in enumerate(event.block_hashes):
            index = item.first_block + i
            if index >= num_full:  # generated tokens: not the prompt's
                break
            chunk = tuple(event.token_ids[i * size : (i + 1) * size])
            by_index.setdefault(index, _Block(index, engine_hash, parent, chunk, extras[i]))
            parent = engine_hash
    blocks: list[_Block] = []
    while len(blocks) in by_index:
        blocks.append(by_index[len(blocks)])
    return blocks


def _short(values: Sequence[object], limit: int = 6) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


def _check_block_size(expected: Expected, found: list[_PromptEvent]) -> list[Mismatch]:
    sizes = sorted({p.event.block_size for p in found})
    if sizes == [expected.block_size]:
        return []
    used = "/".join(str(s) for s in sizes)
    return [
        Mismatch(
            "block_size", f"block size: events use {used}, kvindex expects {expected.block_size}"
        )
    ]


def _check_tokens(expected: Expected, blocks: list[_Block], size: int) -> list[Mismatch]:
    num_full = len(expected.tokens) // size
    if len(blocks) < num_full:
        return [
            Mismatch(
                "token_ids",
                f"token ids: events cover {len(blocks)} of the prompt's {num_full} full blocks "
                f"(block {len(blocks)} missing)",
            )
        ]
    for block in blocks:
        want = expected.tokens[block.index * size : (block.index + 1) * size]
        if block.token_ids != want:
            return [
                Mismatch(
                    "token_ids",
                    f"token ids differ on block {block.index}: events "
                    f"{_short(block.token_ids)}, prompt {_short(want)}",
                )
            ]
    return []


def _check_chain(blocks: list[_Block]) -> list[Mismatch]:
    previous: _Block | None = None
    for block in blocks:
        if previous is None and block.parent_hash is not None:
            return [
                Mismatch(
                    "chain",
                    f"chain: block 0 has parent {block.parent_hash:#x}, expected null "
                    "(the start of a sequence)",
                )
            ]
        if previous is not None and block.parent_hash != previous.engine_hash:
            parent = "null" if block.parent_hash is None else f"{block.parent_hash:#x}"
            return [
                Mismatch(
                    "chain",
                    f"chain: block {block.index}'s parent {parent} is not block "
                    f"{previous.index}'s hash {previous.engine_hash:#x}",
                )
            ]
        previous = block
    return []


def _check_extras(expected: Expected, blocks: list[_Block]) -> list[Mismatch]:
    wanted = request_extra_keys(len(blocks), expected.lora_name, expected.cache_salt)
    differing = []
    for block in blocks:
        want = wanted[block.index] if wanted is not None else None
        want_tuple = tuple(want) if want else ()
        if block.extra_keys != want_tuple:
            differing.append((block.index, list(block.extra_keys), list(want_tuple)))
    if not differing:
        return []
    index, got, want_list = differing[0]
    more = f" (and {len(differing) - 1} more blocks)" if len(differing) > 1 else ""
    return [
        Mismatch(
            "extra_keys",
            f"extra keys differ on block {index}{more}: events {got!r}, request {want_list!r}",
        )
    ]


def event_keys(model: str, found: list[_PromptEvent], blocks: list[_Block]) -> list[int | None]:
    """kvindex keys of ``blocks`` computed from the events exactly as the indexer does."""
    index = MemoryIndex()
    ingestor = Ingestor(index)
    batches = [EventBatch(i + 1, 0.0, 0, (p.event,)) for i, p in enumerate(found)]
    ingestor.apply_many(_STREAM, model, batches)
    return index.resolve(_STREAM, [b.engine_hash for b in blocks])


def _check_keys(expected: Expected, from_events: list[int | None]) -> list[Mismatch]:
    from_request = block_keys(
        expected.model,
        expected.tokens,
        expected.block_size,
        lora_name=expected.lora_name,
        cache_salt=expected.cache_salt,
    )
    for i, (got, want) in enumerate(zip(from_events, from_request, strict=False)):
        if got != want:
            shown = "none (the indexer dropped the event)" if got is None else f"{got:#x}"
            return [
                Mismatch(
                    "keys",
                    f"kvindex keys differ on block {i}: from events {shown}, "
                    f"from the request {want:#x}",
                )
            ]
    if len(from_events) != len(from_request):
        return [
            Mismatch(
                "keys",
                f"kvindex keys: events give {len(from_events)} keys, "
                f"the request {len(from_request)}",
            )
        ]
    return []


def compare(expected: Expected, batches: Sequence[ObservedBatch]) -> CheckReport:
    """Every check of the expected blocks against the events; mismatches most basic first."""
    found = prompt_events(expected.tokens, batches)
    report = CheckReport(
        ok=False,
        expected_block_size=expected.block_size,
        num_prompt_tokens=len(expected.tokens),
        lora_name=expected.lora_name,
        cache_salt=expected.cache_salt,
    )
    if not found:
        report.mismatches.append(Mismatch("events", "no BlockStored events for the prompt"))
        return report
    size = found[0].event.block_size
    blocks = _blocks(expected.tokens, found)
    report.block_size = size
    report.num_blocks = len(blocks)
    report.hash_forms = sorted({p.batch.hash_form for p in found})
    report.encodings = sorted({p.batch.encoding for p in found})
    report.sources = sorted({p.batch.source for p in found})
    report.producers = sorted({p.batch.producer for p in found})
    report.mismatches = [
        *_check_block_size(expected, found),
        *_check_tokens(expected, blocks, size),
        *_check_chain(blocks),
        *_check_extras(expected, blocks),
        *_check_keys(expected, event_keys(expected.model, found, blocks)),
    ]
    report.ok = not report.mismatches
    return report


def is_complete(expected: Expected, batches: Sequence[ObservedBatch]) -> bool:
    """True once events cover every full block of the prompt (in their block size)."""
    found = prompt_events(expected.tokens, batches)
    if not found:
        return False
    size = found[0].event.block_size
    return len(_blocks(expected.tokens, found)) >= len(expected.tokens) // size


# --- talking to the replica -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CheckSettings:
    """One check-hash run."""

    url: str
    """Base URL of the replica's OpenAI server (``http://host:8000``)."""
    events: str
    """The replica's KV-event PUB endpoint (``tcp://host:5557``)."""
    model: str
    """The model name the indexer keys this replica's blocks under (the base model)."""
    block_size: int = 16
    """The block size kvindex expects."""
    lora_name: str | None = None
    """LoRA adapter of the request (sent as the request's ``model``, as vLLM expects)."""
    cache_salt: str | None = None
    replay: str | None = None
    """The replica's replay endpoint: used when live events were missed."""
    topic: str = ""
    """SUB topic prefix ("" = everything)."""
    request_model: str | None = None
    """``model`` sent in the request (default: the LoRA name if any, else ``model``)."""
    mode: PromptMode = "tokens"
    """Send token ids, or text and learn its tokens from ``/tokenize``."""
    num_blocks: int = 4
    """Full blocks in the prompt (plus half a block, never stored)."""
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        """Raise :class:`CheckHashError` naming the option of a malformed endpoint."""
        try:
            check_endpoint("--events", self.events)
            check_endpoint("--replay", self.replay)
        except SettingsError as exc:
            raise CheckHashError(str(exc)) from None


def _random_tokens(count: int) -> list[int]:
    rng = random.Random(secrets.randbits(64))
    return [rng.randrange(*_TOKEN_RANGE) for _ in range(count)]


class _Replica:
    """The replica's HTTP API and its KV-event SUB socket."""

    def __init__(self, settings: CheckSettings, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.settings = settings
        self.http = httpx.Client(base_url=settings.url, timeout=max(settings.timeout_s, 10.0))
        self.sub: zmq.Socket[bytes] = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, settings.topic.encode())
        try:
            self.sub.connect(settings.events)
        except zmq.ZMQError as exc:  # e.g. a host ZeroMQ cannot parse
            self.close()
            raise CheckHashError(f"--events {settings.events!r}: {exc}") from None
        self.batches: list[ObservedBatch] = []
        self.first_seq: int | None = None

    def close(self) -> None:
        self.sub.close(linger=0)
        self.http.close()

    @property
    def request_model(self) -> str:
        s = self.settings
        return s.request_model or s.lora_name or s.model

    def post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            response = self.http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise CheckHashError(f"cannot reach the replica at {self.settings.url}: {exc}") from exc
        if response.status_code != 200:
            raise CheckHashError(f"{path} answered {response.status_code}: {response.text[:300]}")
        return response.json()

    def complete(self, prompt: str | list[int]) -> None:
        body: dict[str, Any] = {"model": self.request_model, "prompt": prompt, "max_tokens": 1}
        if self.settings.cache_salt is not None:
            body["cache_salt"] = self.settings.cache_salt
        self.post("/v1/completions", body)

    def tokenize(self, text: str) -> list[int]:
        answer = self.post("/tokenize", {"model": self.request_model, "prompt": text})
        return [int(t) for t in answer["tokens"]]

    def receive(self, wait_s: float) -> int:
        """Read every message arriving within ``wait_s``; returns how many came."""
        count = 0
        deadline = time.monotonic() + wait_s
        while self.sub.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN):
            frames = self.sub.recv_multipart()
            count += 1
            try:
                live = decode_live(frames)
            except WireError:
                continue
            if self.first_seq is None:
                self.first_seq = live.batch.seq
            encoding, form = payload_shape(frames[2])
            producer = payload_producer(frames[2])
            self.batches.append(_observed(live.batch, encoding, form, "live", producer))
            if time.monotonic() >= deadline:
                break
        return count

    def wait_live(self) -> bool:
        """Send throwaway requests until an event arrives (the SUB is then subscribed)."""
        deadline = time.monotonic() + self.settings.timeout_s
        while time.monotonic() < deadline:
            self.complete(_random_tokens(_WARMUP_TOKENS))
            if self.receive(min(0.5, max(0.0, deadline - time.monotonic()))):
                return True
        return False


def _observed(
    batch: EventBatch, encoding: str, form: str, source: str, producer: str = "unknown"
) -> ObservedBatch:
    stored = tuple(e for e in batch.events if isinstance(e, BlockStored))
    return ObservedBatch(batch.seq, stored, encoding, form, source, producer)


def _prompt(replica: _Replica) -> tuple[str | list[int], list[int]]:
    """(what to send, its exact token ids): a unique prompt of ``num_blocks`` + 1/2 blocks."""
    s = replica.settings
    count = s.num_blocks * s.block_size + max(1, s.block_size // 2)
    if s.mode == "tokens":
        tokens = _random_tokens(count)
        return tokens, tokens
    text = " ".join(f"kvcheck{secrets.token_hex(3)}" for _ in range(count))
    return text, replica.tokenize(text)


def _collect(replica: _Replica, expected: Expected) -> None:
    deadline = time.monotonic() + replica.settings.timeout_s
    while not is_complete(expected, replica.batches) and time.monotonic() < deadline:
        replica.receive(min(0.1, max(0.0, deadline - time.monotonic())))


def _replay(
    replica: _Replica, context: zmq.Context[zmq.Socket[bytes]], endpoint: str
) -> str | None:
    """Add replayed batches not seen live; returns a note when the replay failed."""
    seen = {b.seq for b in replica.batches}
    start = replica.first_seq or 0
    try:
        batches = fetch_replay(context, endpoint, start, timeout_s=replica.settings.timeout_s)
    except ReplayTimeoutError as exc:
        return str(exc)
    replica.batches += [
        _observed(b, "unknown", "unknown", "replay") for b in batches if b.seq not in seen
    ]
    return None


def run_check(settings: CheckSettings) -> CheckReport:
    """The whole check on a live replica (:class:`CheckHashError`: its HTTP API unusable)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        replica = _Replica(settings, context)
    except BaseException:
        context.term()
        raise
    try:
        live = replica.wait_live()
        sent, tokens = _prompt(replica)
        expected = Expected(
            settings.model,
            tuple(tokens),
            settings.block_size,
            settings.lora_name,
            settings.cache_salt,
        )
        replica.batches.clear()
        replica.complete(sent)
        if live:
            _collect(replica, expected)
        note = None
        if settings.replay and not is_complete(expected, replica.batches):
            note = _replay(replica, context, settings.replay)
        report = compare(expected, replica.batches)
    finally:
        replica.close()
        context.term()
    _explain_missing(report, settings, live, note)
    return report


def _explain_missing(
    report: CheckReport, settings: CheckSettings, live: bool, note: str | None
) -> None:
    if not report.mismatches or report.mismatches[0].check != "events":
        return
    detail = "" if live else f" (no event at all from {settings.events})"
    if note:
        detail += f"; replay: {note}"
    report.mismatches[0] = Mismatch(
        "events",
        f"no BlockStored events for the prompt within {settings.timeout_s:g} s{detail}: {_HINT}",
    )
