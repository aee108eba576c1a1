"""Workload generators and the Mooncake trace reader: one home for the requests that
``kvindex simulate`` and the benchmarks send.

A :class:`TraceRequest` is what arrives at the router: an arrival time, a prompt, an output
length and, when the workload has one, a session key. Prompts are token ids:

* **Mooncake traces** (JSONL: ``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids`` of 512-token blocks; equal ids mean an identical prefix) carry no text, so
  each block id gets deterministic synthetic tokens (:func:`block_tokens`): identical ids
  give identical tokens, different ids different ones. The last block of a request holds
  what is left of ``input_length``. The trace has no session ids: a request's session is
  the first block after the prefix it shares with many others (:func:`trace_sessions`: its
  conversation or document, not the system prompt every request starts with).
* **Generators** (:data:`WORKLOADS`), each a function of a seed and a size:
  ``system_prompts`` (groups of users behind long shared system prompts), ``multi_turn``
  (chats whose prompt is the whole history, the model's answers included), ``rag`` (a
  shared, Zipf-popular pool of document chunks), ``few_shot`` (long few-shot templates) and
  ``unique`` (short prompts that share nothing: routing by cache cannot help there).
  Arrivals are Poisson at ``rate`` requests/s.
* **Request logs** (:func:`logged_trace`): the user's own requests, tokenized
  (:mod:`kvindex.clients.workloads.request_log`). Arrivals are the log's timestamps (relative to the
  first) when every request has one and no rate is given, else Poisson at ``rate``
  (default :data:`DEFAULT_LOG_RATE`) in log order. A request's output length is its
  ``max_tokens`` (an upper bound: real answers are often shorter), else
  :data:`DEFAULT_OUTPUT_TOKENS`; its session is its conversation (``user``, else its first
  two messages). Answers are not reused as cached blocks (their tokens are not logged).
* **Closed-loop chats** (:class:`ChatSessions`): a replica under saturating load asks for
  its next request whenever it has room, and a chat's next turn waits for its last one to
  end, so there are no arrival times. The ingest benchmark's replicas run on them.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import math
import random
import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import msgspec

from kvindex.indexer.domain.errors import KvIndexError

if TYPE_CHECKING:  # the reader pulls in the tokenizers; a trace or a generator needs none
    from kvindex.clients.workloads.request_log import TokenizedRequest

TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in Mooncake traces."""
VOCAB = 32_000
"""Generated token ids are below this (a Llama-2-sized vocabulary)."""


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
    """The answer's tokens when the workload knows them (a chat's next turn repeats them);
    None: the answer is never reused, so its blocks are not cached."""

    def tokens(self) -> list[int]:
        if self.prompt is not None:
            return list(self.prompt)
        return trace_tokens(self.hash_ids, self.input_length)


# --- Mooncake traces -------------------------------------------------------------------------


def block_tokens(block_id: int, num_tokens: int = TRACE_BLOCK_TOKENS) -> list[int]:
    """Deterministic tokens (ids below 65,536) of one trace block: the first ``num_tokens``
    of its 512."""
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
    """Read a Mooncake JSONL trace (plain or ``.gz``), sorted by arrival, each request's
    session derived by :func:`trace_sessions`."""
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
"""A block followed by at least this many different blocks (and by at least
:data:`SHARED_MIN_SHARE` of the requests' count) is shared content, not a session."""
SHARED_MIN_SHARE = 0.01


def trace_sessions(hash_ids_of: Sequence[Sequence[int]]) -> list[str]:
    """A session key per request of a trace without session ids, from each request's
    chained block ids (an id names a block and its whole prefix: Mooncake's ``hash_ids``,
    or the engine's block hashes of a prompt).

    The shared prefix of a request ends after its deepest block that many different
    continuations follow (at least :data:`SHARED_MIN_FANOUT`, and at least
    :data:`SHARED_MIN_SHARE` of the number of requests: a system prompt or a tool list
    everyone sends, not a document a few questions share); its session is the first block
    after it (``b<id>``). A chat's later turns extend its first one, so they keep its
    session; requests that only share a system prompt get sessions of their own instead of
    all landing on one replica. A request that is all shared prefix is keyed by its last
    block."""
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
    """Blocks followed by at least ``threshold`` different next blocks. Memory: one int
    per block with one successor, a set only for blocks with several (counted no further
    than ``threshold``)."""
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


# --- generators ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GeneratorSettings:
    requests: int = 2000
    """How many requests to make."""
    rate: float | None = None
    """Mean arrivals per second (Poisson); None: the workload's :data:`DEFAULT_RATES`."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise WorkloadError(f"requests must be >= 1, got {self.requests}")
        if self.rate is not None and not self.rate > 0:
            raise WorkloadError(f"rate must be > 0, got {self.rate}")

    def rate_for(self, workload: str) -> float:
        return self.rate if self.rate is not None else DEFAULT_RATES[workload]


DEFAULT_RATES = {
    "system_prompts": 20.0,
    "multi_turn": 20.0,
    "rag": 20.0,
    "few_shot": 15.0,
    "unique": 100.0,
}
"""Arrivals/s that load the default fleet (8 replicas, 12,000 prefill tokens/s each) to
roughly half its prefill capacity with no cache hits, so that queues form and load matters."""


def _tokens(rng: random.Random, n: int, vocab: int = VOCAB) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _arrivals(rng: random.Random, rate: float) -> Iterator[float]:
    t = 0.0
    while True:
        yield t
        t += rng.expovariate(rate)


def _zipf(rng: random.Random, n: int, s: float = 1.1) -> int:
    return rng.choices(range(n), weights=[1 / (i + 1) ** s for i in range(n)])[0]


@dataclass(frozen=True, slots=True)
class UserSession:
    """One user's requests. A chat's turn k prompt is the whole history so far (previous
    prompt + the replica's answer) + ``turns[k]``; a RAG query is ``system + turns[k]``."""

    system: list[int]
    turns: list[list[int]]
    chat: bool


def user_sessions(num_requests: int, seed: int, *, vocab: int = VOCAB) -> list[UserSession]:
    """Sessions totalling exactly ``num_requests`` turns; a function of the seed only.

    70% chats (2-6 turns of 30-120 user tokens) and 30% RAG sessions (1-3 queries, each 3
    chunks of 160 tokens from a pool of 40, Zipf-popular, + a 20-60 token question), over 4
    system prompts of 300-600 tokens chosen Zipf-like (a few apps dominate). Token ids are
    below ``vocab``. The demo replays them; their answers join a chat's history."""
    rng = random.Random(seed)
    systems = [_tokens(rng, rng.randint(300, 600), vocab) for _ in range(4)]
    chunks = [_tokens(rng, 160, vocab) for _ in range(40)]
    sessions: list[UserSession] = []
    remaining = num_requests
    while remaining > 0:
        system = systems[_zipf(rng, len(systems))]
        if rng.random() < 0.7:
            turns = [_tokens(rng, rng.randint(30, 120), vocab) for _ in range(rng.randint(2, 6))]
            session = UserSession(system, turns[:remaining], chat=True)
        else:
            turns = [_rag_query(rng, chunks, vocab) for _ in range(rng.randint(1, 3))]
            session = UserSession(system, turns[:remaining], chat=False)
        sessions.append(session)
        remaining -= len(session.turns)
    return sessions


def _rag_query(rng: random.Random, chunks: list[list[int]], vocab: int) -> list[int]:
    picked: list[int] = []
    while len(picked) < 3:
        i = _zipf(rng, len(chunks))
        if i not in picked:
            picked.append(i)
    return [t for i in picked for t in chunks[i]] + _tokens(rng, rng.randint(20, 60), vocab)


def system_prompts(settings: GeneratorSettings) -> list[TraceRequest]:
    """16 apps with system prompts of 1-4k tokens, Zipf-popular; each request is one app's
    prompt + a 50-300-token user question; 100-400 output tokens."""
    rng = random.Random(settings.seed)
    rate = settings.rate_for("system_prompts")
    apps = [_tokens(rng, rng.randint(1024, 4096)) for _ in range(16)]
    out: list[TraceRequest] = []
    for _, t in zip(range(settings.requests), _arrivals(rng, rate), strict=False):
        app = _zipf(rng, len(apps))
        prompt = apps[app] + _tokens(rng, rng.randint(50, 300))
        out.append(TraceRequest(t, len(prompt), rng.randint(100, 400), f"app{app}", prompt))
    return out


def multi_turn(settings: GeneratorSettings) -> list[TraceRequest]:
    """Chats of 3-10 turns behind one of 4 system prompts; turn k's prompt is the whole
    history (earlier questions and answers) + a new 30-200-token question; answers are
    100-300 tokens; 5-30 s between turns of one chat. Chats start at Poisson times."""
    rng = random.Random(settings.seed)
    rate = settings.rate_for("multi_turn")
    systems = [_tokens(rng, rng.randint(500, 1500)) for _ in range(4)]
    turns_per_chat = 6.5
    chat_rate = rate / turns_per_chat
    out: list[TraceRequest] = []
    start = 0.0
    chat = 0
    while len(out) < settings.requests:
        history = list(systems[_zipf(rng, len(systems))])
        t = start
        for _ in range(rng.randint(3, 10)):
            history += _tokens(rng, rng.randint(30, 200))
            answer = _tokens(rng, rng.randint(100, 300))
            out.append(
                TraceRequest(t, len(history), len(answer), f"chat{chat}", history, output=answer)
            )
            history = history + answer
            t += rng.uniform(5.0, 30.0)
        chat += 1
        start += rng.expovariate(chat_rate)
    out.sort(key=lambda r: r.arrival_s)
    return out[: settings.requests]


def rag(settings: GeneratorSettings) -> list[TraceRequest]:
    """A 300-token system prompt, then 4 chunks of 512 tokens from a pool of 400, the first
    chunk Zipf-popular (a hot document), the rest uniform; a 20-100-token question."""
    rng = random.Random(settings.seed)
    rate = settings.rate_for("rag")
    system = _tokens(rng, 300)
    chunks = [_tokens(rng, 512) for _ in range(400)]
    out: list[TraceRequest] = []
    for _, t in zip(range(settings.requests), _arrivals(rng, rate), strict=False):
        first = _zipf(rng, len(chunks))
        picked = [chunks[first]] + [chunks[rng.randrange(len(chunks))] for _ in range(3)]
        prompt = (
            system + [tok for chunk in picked for tok in chunk] + _tokens(rng, rng.randint(20, 100))
        )
        out.append(TraceRequest(t, len(prompt), rng.randint(50, 300), f"doc{first}", prompt))
    return out


def few_shot(settings: GeneratorSettings) -> list[TraceRequest]:
    """8 task templates of 2-6k tokens (instructions + examples), uniform; each request
    appends a 100-400-token input; 20-100 output tokens (classification, extraction)."""
    rng = random.Random(settings.seed)
    rate = settings.rate_for("few_shot")
    templates = [_tokens(rng, rng.randint(2048, 6144)) for _ in range(8)]
    out: list[TraceRequest] = []
    for _, t in zip(range(settings.requests), _arrivals(rng, rate), strict=False):
        task = rng.randrange(len(templates))
        prompt = templates[task] + _tokens(rng, rng.randint(100, 400))
        out.append(TraceRequest(t, len(prompt), rng.randint(20, 100), f"task{task}", prompt))
    return out


def unique(settings: GeneratorSettings) -> list[TraceRequest]:
    """Short prompts of 100-800 random tokens that share nothing; 50-300 output tokens."""
    rng = random.Random(settings.seed)
    rate = settings.rate_for("unique")
    out: list[TraceRequest] = []
    for i, t in zip(range(settings.requests), _arrivals(rng, rate), strict=False):
        prompt = _tokens(rng, rng.randint(100, 800))
        out.append(TraceRequest(t, len(prompt), rng.randint(50, 300), f"u{i}", prompt))
    return out


WORKLOADS: dict[str, Callable[[GeneratorSettings], list[TraceRequest]]] = {
    "system_prompts": system_prompts,
    "multi_turn": multi_turn,
    "rag": rag,
    "few_shot": few_shot,
    "unique": unique,
}


# --- request logs --------------------------------------------------------------------------

DEFAULT_LOG_RATE = 20.0
"""Arrivals/s of a request log whose requests lack timestamps (and no rate was given)."""
DEFAULT_OUTPUT_TOKENS = 256
"""Output tokens of a logged request without ``max_tokens``."""


def logged_trace(
    requests: Sequence[TokenizedRequest], *, rate: float | None = None, seed: int = 0
) -> list[TraceRequest]:
    """The logged requests as the simulator replays them, sorted by arrival."""
    if not requests:
        raise WorkloadError("the request log has no usable request")
    if rate is not None and not rate > 0:
        raise WorkloadError(f"rate must be > 0, got {rate}")
    stamps = [r.request.timestamp_s for r in requests]
    if rate is None and all(s is not None for s in stamps):
        first = min(s for s in stamps if s is not None)
        arrivals = [s - first for s in stamps if s is not None]
    else:
        gaps = _arrivals(random.Random(seed), rate or DEFAULT_LOG_RATE)
        arrivals = [t for t, _ in zip(gaps, requests, strict=False)]
    out = [_logged(r, t) for r, t in zip(requests, arrivals, strict=True)]
    out.sort(key=lambda r: r.arrival_s)
    return out


def _logged(done: TokenizedRequest, arrival_s: float) -> TraceRequest:
    request = done.request
    output = request.max_tokens if request.max_tokens is not None else DEFAULT_OUTPUT_TOKENS
    prompt = array("I", done.tokens)  # 4 bytes a token, not a list's 36
    return TraceRequest(arrival_s, len(prompt), output, request.conversation(), prompt)


# --- closed-loop chats ---------------------------------------------------------------------

CHAT_VOCAB = 128_256
"""Llama 3's vocabulary (about half of the token ids need a 5-byte msgpack integer)."""
MAX_CHAT_TOKENS = 6_144
"""A chat ends once its history is this long."""
_CHAT_PROMPT_BLOCKS = (20, 60)
_CHAT_USER_TOKENS = (32, 768)
_CHAT_OUTPUT_TOKENS = (32, 512)
_CHAT_TURNS = (1, 8)
_P_CONTINUE = 0.7
"""Chance that the next request is another turn of an idle chat."""


def random_tokens(rng: random.Random, count: int) -> list[int]:
    """``count`` token ids below :data:`CHAT_VOCAB`, drawn as bytes (fast for long prompts).

    The chats' ids span Llama 3's vocabulary, as the payloads the ingest benchmark times
    must; the :data:`WORKLOADS` generators keep their own draw below :data:`VOCAB`
    (changing it would change every simulated figure)."""
    return [t % CHAT_VOCAB for t in array("I", rng.randbytes(count * 4))]


def chat_system_prompts(seed: int, count: int, block_size: int = 16) -> list[list[int]]:
    """``count`` system prompts of tens of blocks each (not block-aligned), from ``seed``."""
    rng = random.Random(seed)
    low, high = _CHAT_PROMPT_BLOCKS
    return [
        random_tokens(rng, rng.randint(low, high) * block_size + rng.randrange(block_size))
        for _ in range(count)
    ]


@dataclass(slots=True, eq=False)
class Chat:
    """One conversation: its history so far, behind one of the system prompts."""

    system_prompt: int
    """Index of the system prompt it started from."""
    tokens: list[int]
    turns_left: int


@dataclass(frozen=True, slots=True, eq=False)
class ChatTurn:
    """One request: the chat's history, a new user message, then the answer (drawn up
    front; a replica reveals it by decoding)."""

    chat: Chat
    tokens: list[int]
    """Prompt then output."""
    num_prompt_tokens: int


class ChatSessions:
    """Chats for one replica under saturating load (the ingest benchmark's workload).

    :meth:`next_turn` is another turn of an idle chat (always once ``max_idle`` chats are
    idle, else with probability 0.7) or the first turn of a new chat, behind a system prompt
    picked with weights 1, 1/2, 1/3, ...; :meth:`end_turn` makes the chat idle again until
    its 1-8 turns are done or its history reaches :data:`MAX_CHAT_TOKENS`. User messages
    are 32-768 tokens, answers 32-512. Every draw comes from ``rng``, in call order, so a
    run is a function of the seed and of the order of the calls.
    """

    def __init__(
        self, rng: random.Random, system_prompts: Sequence[list[int]], *, max_idle: int
    ) -> None:
        self._rng = rng
        self._prompts = system_prompts
        self._weights = [1.0 / (i + 1) for i in range(len(system_prompts))]
        self._max_idle = max_idle
        self._idle: list[Chat] = []

    def next_turn(self) -> ChatTurn:
        chat = self._pick()
        rng = self._rng
        user = random_tokens(rng, rng.randint(*_CHAT_USER_TOKENS))
        output = random_tokens(rng, rng.randint(*_CHAT_OUTPUT_TOKENS))
        return ChatTurn(chat, chat.tokens + user + output, len(chat.tokens) + len(user))

    def end_turn(self, turn: ChatTurn) -> bool:
        """The turn is answered: its tokens become the chat's history. True if the chat
        goes on (it is idle until a :meth:`next_turn` picks it)."""
        chat = turn.chat
        chat.tokens = turn.tokens
        chat.turns_left -= 1
        if chat.turns_left > 0 and len(turn.tokens) < MAX_CHAT_TOKENS:
            self._idle.append(chat)
            return True
        return False

    def _pick(self) -> Chat:
        idle, rng = self._idle, self._rng
        if idle and (len(idle) >= self._max_idle or rng.random() < _P_CONTINUE):
            i = rng.randrange(len(idle))
            idle[i], idle[-1] = idle[-1], idle[i]
            return idle.pop()
        index = rng.choices(range(len(self._prompts)), self._weights)[0]
        return Chat(index, list(self._prompts[index]), rng.randint(*_CHAT_TURNS))
