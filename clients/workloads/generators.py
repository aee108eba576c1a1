"""Generated workloads (:data:`WORKLOADS`), each a function of a seed and a size, and the
demo's sessions (:func:`user_sessions`)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from kvindex.clients.workloads.trace import TraceRequest, WorkloadError, poisson_arrivals

VOCAB = 32_000
"""Generated token ids are below this (a Llama-2-sized vocabulary)."""


@dataclass(frozen=True, slots=True)
class GeneratorSettings:
    requests: int = 2000
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
"""Arrivals/s that load the default fleet to about half its prefill capacity."""


def _tokens(rng: random.Random, n: int, vocab: int = VOCAB) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _zipf(rng: random.Random, n: int, s: float = 1.1) -> int:
    return rng.choices(range(n), weights=[1 / (i + 1) ** s for i in range(n)])[0]


@dataclass(frozen=True, slots=True)
class UserSession:
    """One user's requests: a chat's turn k repeats its history; RAG's is ``system + turns[k]``."""

    system: list[int]
    turns: list[list[int]]
    chat: bool


def user_sessions(num_requests: int, seed: int, *, vocab: int = VOCAB) -> list[UserSession]:
    """Sessions totalling ``num_requests`` turns (70% chats, 30% RAG), a function of the seed."""
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
    """16 Zipf-popular apps' system prompts of 1-4k tokens, each + a 50-300-token question."""
    rng = random.Random(settings.seed)
    rate = settings.rate_for("system_prompts")
    apps = [_tokens(rng, rng.randint(1024, 4096)) for _ in range(16)]
    out: list[TraceRequest] = []
    for _, t in zip(range(settings.requests), poisson_arrivals(rng, rate), strict=False):
        app = _zipf(rng, len(apps))
        prompt = apps[app] + _tokens(rng, rng.randint(50, 300))
        out.append(TraceRequest(t, len(prompt), rng.randint(100, 400), f"app{app}", prompt))
    return out


def multi_turn(settings: GeneratorSettings) -> list[TraceRequest]:
    """Chats of 3-10 turns behind 4 system prompts, each turn's prompt their whole history."""
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
    """A system prompt, 4 chunks of 512 tokens (the first Zipf-popular), a short question."""
    rng = random.Random(settings.seed)
    rate = settings.rate_for("rag")
    system = _tokens(rng, 300)
    chunks = [_tokens(rng, 512) for _ in range(400)]
    out: list[TraceRequest] = []
    for _, t in zip(range(settings.requests), poisson_arrivals(rng, rate), strict=False):
        first = _zipf(rng, len(chunks))
        picked = [chunks[first]] + [chunks[rng.randrange(len(chunks))] for _ in range(3)]
        prompt = (
            system + [tok for chunk in picked for tok in chunk] + _tokens(rng, rng.randint(20, 100))
        )
        out.append(TraceRequest(t, len(prompt), rng.randint(50, 300), f"doc{first}", prompt))
    return out


def few_shot(settings: GeneratorSettings) -> list[TraceRequest]:
    """8 few-shot templates of 2-6k tokens, each + a 100-400-token input; short outputs."""
    rng = random.Random(settings.seed)
    rate = settings.rate_for("few_shot")
    templates = [_tokens(rng, rng.randint(2048, 6144)) for _ in range(8)]
    out: list[TraceRequest] = []
    for _, t in zip(range(settings.requests), poisson_arrivals(rng, rate), strict=False):
        task = rng.randrange(len(templates))
        prompt = templates[task] + _tokens(rng, rng.randint(100, 400))
        out.append(TraceRequest(t, len(prompt), rng.randint(20, 100), f"task{task}", prompt))
    return out


def unique(settings: GeneratorSettings) -> list[TraceRequest]:
    """Short prompts of 100-800 random tokens that share nothing; 50-300 output tokens."""
    rng = random.Random(settings.seed)
    rate = settings.rate_for("unique")
    out: list[TraceRequest] = []
    for i, t in zip(range(settings.requests), poisson_arrivals(rng, rate), strict=False):
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
