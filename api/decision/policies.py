"""Routing policies: pure functions from (matches, load, freshness) to ranked scores, the
reference of every fast copy; :func:`decide` is the entry point (ScoringError: a policy or
weight that cannot be used). ``kv_aware`` (the default)::

    cache = w.cache · Σ tier_credit(tier) / num_blocks · freshness_factor
            (· w.over_predicted_factor for a replica found over-predicted)
    queue = max((w.waiting · waiting + w.running · running) · recency + w.routed · routed,
                w.in_flight · in_flight)
    score = cache - (queue + w.kv_usage · kv_usage · recency + w.in_flight_tokens · tokens)

with ``recency = 0.5 ** (age / w.load_half_life_s)``; ties go to the lower load, then chance."""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import msgspec
import xxhash

from kvindex.api.load.model import CountedLoad
from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.events import Tier
from kvindex.indexer.fleet.registry import Freshness
from kvindex.indexer.index.protocol import gpu_count
from kvindex.indexer.native import _lookup


class Policy(enum.StrEnum):
    KV_AWARE = "kv_aware"
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    LEAST_LOAD = "least_load"
    SESSION_AFFINITY = "session_affinity"
    PREFIX_HASH = "prefix_hash"


class ScoringError(KvIndexError):
    """A policy or weight that cannot be used."""


@dataclass(frozen=True, slots=True)
class Weights:
    """Every knob of the scoring formulas (``[api.weights]``)."""

    cache: float = 1.0
    """Weight of the cache term (the whole prompt cached on GPU is worth this)."""
    gpu: float = 1.0
    """Credit of a block matched on GPU."""
    cpu: float = 0.8
    """Credit of a block matched only on CPU (offloaded: must be copied back)."""
    other: float = 0.5
    """Credit of a block matched only on another tier (disk, remote)."""
    waiting: float = 0.1
    """Penalty per waiting (queued) request."""
    running: float = 0.02
    """Penalty per running request."""
    kv_usage: float = 0.2
    """Penalty for a full KV cache (usage fraction 0..1)."""
    routed: float = 0.1
    """Penalty per answer naming the replica since its load was stored (load not yet shown)."""
    in_flight: float = 0.02
    """Penalty per request in flight to the replica (reserved by the proxies)."""
    in_flight_tokens: float = 0.00005
    """Penalty per uncached prompt token of the requests in flight (their prefill work)."""
    stale_factor: float = 0.5
    """Cache credit multiplier for a replica whose stream is stale."""
    replaying_factor: float = 0.8
    """Cache credit multiplier while a replica's stream is being replayed."""
    over_predicted_factor: float = 0.25
    """Cache credit multiplier of a replica the proxy found over-predicted, until exact again."""
    load_half_life_s: float = 10.0
    """Load this old counts half."""
    temperature: float = 0.0
    """Softmax temperature over scores; 0 picks the maximum."""
    prefix_blocks: int = 8
    """Leading blocks hashed by the ``prefix_hash`` policy."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            # bool is an int: reject it explicitly, it is never a weight.
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ScoringError(f"weight {f.name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ScoringError(f"weight {f.name} must be finite and >= 0, got {value!r}")
        # JSON and TOML may give a count as 4.0; it is used as a slice bound.
        if not float(self.prefix_blocks).is_integer():
            raise ScoringError(
                f"weight prefix_blocks must be a whole number, got {self.prefix_blocks!r}"
            )
        object.__setattr__(self, "prefix_blocks", int(self.prefix_blocks))

    def overridden(self, overrides: dict[str, Any] | None) -> Weights:
        """A copy with some weights replaced; ScoringError for an unknown name or bad value."""
        if not overrides:
            return self
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ScoringError(f"unknown weights {unknown}; known: {sorted(known)}")
        try:
            return replace(self, **overrides)
        except TypeError as exc:
            raise ScoringError(str(exc)) from exc

    def as_dict(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


# The per-request types below are frozen msgspec Structs rather than frozen dataclasses: a
# request builds one of each per candidate, and a Struct is built much faster. They hold
# no object that could refer back to them (no cycle): the collector does not track them.


class LoadInput(msgspec.Struct, frozen=True, gc=False):
    running: float
    waiting: float
    kv_usage: float
    age_s: float
    routed: float = 0.0


class Candidate(msgspec.Struct, frozen=True, gc=False):
    """What the scorer knows of one replica for one request."""

    replica: str
    tiers: Sequence[Tier]
    """Best tier of each matched leading block (its longest prefix over all ranks)."""
    freshness: Freshness
    load: LoadInput | None
    in_flight: float = 0.0
    in_flight_tokens: float = 0.0


class Scored(msgspec.Struct, frozen=True, gc=False):
    replica: str
    score: float
    terms: dict[str, float]


class Decision(msgspec.Struct, frozen=True, gc=False):
    best: str | None
    ranked: list[Scored]
    """Best first."""


def load_penalty(
    load: LoadInput | None, w: Weights, in_flight: float = 0.0, in_flight_tokens: float = 0.0
) -> tuple[float, float]:
    """(penalty, recency); an unknown load costs only the requests in flight (recency 0)."""
    first_hand = w.in_flight * in_flight
    prefill = w.in_flight_tokens * in_flight_tokens
    if load is None:
        return first_hand + prefill, 0.0
    half_life, age = w.load_half_life_s, load.age_s
    # ``0.0 if age < 0.0 else age`` is ``max(age, 0.0)`` without the call (hot: per candidate).
    recency = 0.5 ** ((0.0 if age < 0.0 else age) / half_life) if half_life else 1.0
    # Requests routed since the measurement are recent whatever the load's age: no decay.
    queue = (w.waiting * load.waiting + w.running * load.running) * recency
    queue += w.routed * load.routed
    queue = queue if queue > first_hand else first_hand  # max() without the call
    return queue + w.kv_usage * load.kv_usage * recency + prefill, recency


def candidate_penalty(c: Candidate, w: Weights) -> tuple[float, float]:
    return load_penalty(c.load, w, c.in_flight, c.in_flight_tokens)


def _in_flight_terms(c: Candidate, w: Weights) -> tuple[float, float]:
    return 0.0 - w.in_flight * c.in_flight, 0.0 - w.in_flight_tokens * c.in_flight_tokens


def load_penalties(
    replicas: Sequence[str], counted: Mapping[str, CountedLoad], now: float, w: Weights
) -> list[float]:
    """:func:`load_penalty` of each replica's load as of ``now``, in order, in one compiled loop."""
    if type(replicas) is not list:
        replicas = list(replicas)
    if type(counted) is not dict:
        counted = dict(counted)
    return _lookup.load_penalties(replicas, counted, now, *penalty_weights(w))


def penalty_weights(w: Weights) -> tuple[float, float, float, float, float, float, float]:
    return (
        w.in_flight,
        w.in_flight_tokens,
        w.load_half_life_s,
        w.waiting,
        w.running,
        w.routed,
        w.kv_usage,
    )


def cache_credit(c: Candidate, num_blocks: int, w: Weights) -> tuple[float, float]:
    """(credit, freshness factor): tier-weighted fraction of the prompt cached."""
    return tier_credit(c.tiers, c.freshness, num_blocks, w)


def tier_credit(
    tiers: Sequence[Tier], freshness: Freshness, num_blocks: int, w: Weights
) -> tuple[float, float]:
    factor = _freshness_factor(freshness, w)
    if num_blocks == 0 or not tiers:
        return 0.0, factor
    num_gpu = gpu_count(tiers)
    # All on GPU is the common case: one pass (the zero terms below add nothing).
    num_cpu = 0 if num_gpu == len(tiers) else tiers.count(_CPU)
    num_other = len(tiers) - num_gpu - num_cpu
    weighted = (w.gpu * num_gpu + w.cpu * num_cpu + w.other * num_other) / num_blocks
    return w.cache * weighted * factor, factor


def _freshness_factor(freshness: Freshness, w: Weights) -> float:
    # Partial: the blocks it lacks are not matched, and the ones it holds are right: 1.0.
    if freshness is _STALE:
        return w.stale_factor
    if freshness is _REPLAYING:
        return w.replaying_factor
    return 1.0


# Reading an enum member through its class (``Tier.GPU``) is an attribute lookup more: the
# functions above run per candidate per request, so they use these aliases.
_CPU = Tier.CPU
_STALE, _REPLAYING = Freshness.STALE, Freshness.REPLAYING


def kv_aware(
    cands: Sequence[Candidate],
    num_blocks: int,
    w: Weights,
    credits: Sequence[tuple[float, float] | None] | None = None,
    distrusted: Collection[str] = (),
) -> list[Scored]:
    """Every candidate scored and explained; ``credits``: their :func:`cache_credit` if known."""
    out: list[Scored] = []
    append = out.append
    for i, c in enumerate(cands):
        known = credits[i] if credits is not None else None
        cache, factor = known if known is not None else cache_credit(c, num_blocks, w)
        load, recency = candidate_penalty(c, w)
        in_flight, tokens = _in_flight_terms(c, w)
        terms = {
            "cache": cache,
            "freshness_factor": factor,
            "load": -load,
            "load_recency": recency,
            "in_flight": in_flight,
            "in_flight_tokens": tokens,
        }
        if distrusted and c.replica in distrusted:
            cache = terms["cache"] = distrusted_credit(cache, w)
            terms["prediction_factor"] = w.over_predicted_factor
        append(Scored(c.replica, cache - load, terms))
    return out


def distrusted_credit(cache: float, w: Weights) -> float:
    return cache * w.over_predicted_factor


def least_load(cands: Sequence[Candidate], w: Weights) -> list[Scored]:
    out = []
    for c in cands:
        load, recency = candidate_penalty(c, w)
        in_flight, tokens = _in_flight_terms(c, w)
        terms = {
            "load": -load,
            "load_recency": recency,
            "in_flight": in_flight,
            "in_flight_tokens": tokens,
        }
        out.append(Scored(c.replica, -load, terms))
    return out


def rendezvous(cands: Sequence[Candidate], key: bytes, term: str) -> list[Scored]:
    """Highest-random-weight hashing: a stable owner per key, minimal moves on changes."""
    out = []
    for c in cands:
        weight = xxhash.xxh3_64_intdigest(key + b"\x00" + c.replica.encode()) / 2**64
        out.append(Scored(c.replica, weight, {term: weight}))
    return out


def prefix_key(block_keys: Sequence[int], w: Weights) -> bytes:
    return b"".join(k.to_bytes(8, "big") for k in block_keys[: w.prefix_blocks])


def constant(cands: Sequence[Candidate], chosen: str | None, term: str) -> list[Scored]:
    """Round robin / random: the chosen replica scores 1, the others 0."""
    return [
        Scored(
            c.replica,
            1.0 if c.replica == chosen else 0.0,
            {term: 1.0 if c.replica == chosen else 0.0},
        )
        for c in cands
    ]


def rank(
    scored: list[Scored],
    cands: Sequence[Candidate],
    w: Weights,
    rng: random.Random,
    top_k: int | None = None,
) -> Decision:
    """Best first: by score, then lower load, then chance; softmax draw if temperature."""
    if not scored:
        return Decision(None, [])
    if w.temperature > 0 and len(scored) > 1:  # the draw weighs every one, in order
        tiebreak = {s.replica: rng.random() for s in scored}
        key: Callable[[Scored], Any] = _minus_score
        if len({s.score for s in scored}) != len(scored):  # a tie: lower load, then chance
            key = _tie_key({c.replica: candidate_penalty(c, w)[0] for c in cands}, tiebreak)
        ordered = sorted(scored, key=key)
        best = _softmax_pick(ordered, w.temperature, rng)
        ordered = [best] + [s for s in ordered if s is not best]
        return Decision(best.replica, ordered[: top_k or None])
    minus_scores = [-s.score for s in scored]
    if len(set(minus_scores)) != len(scored):  # a tie: lower load, then chance
        load_of = {c.replica: candidate_penalty(c, w)[0] for c in cands}
        loads = [load_of[s.replica] for s in scored]
    else:  # no two scores equal: the load never decides
        loads = [0.0] * len(scored)
    ordered = [scored[i] for i in tie_order(minus_scores, loads, rng.random, top_k)]
    return Decision(ordered[0].replica, ordered)


def tie_order(
    minus_scores: Sequence[float],
    penalties: Sequence[float],
    draw: Callable[[], float],
    top_k: int | None,
    positions: Sequence[int] | None = None,
) -> list[int]:
    """Indices of the best ``top_k`` (None or 0: all) rows at ``positions``, by (minus score,
    penalty), ties by one ``draw()`` per row of each tied group reached, in index order."""
    picked: Sequence[int] = range(len(minus_scores)) if positions is None else positions
    rows = sorted((minus_scores[i], penalties[i], i) for i in picked)
    k = len(rows) if not top_k or top_k >= len(rows) else top_k
    out: list[int] = []
    start = 0
    while len(out) < k:
        minus, penalty, _ = rows[start]
        end = start + 1
        while end < len(rows) and rows[end][0] == minus and rows[end][1] == penalty:
            end += 1
        if end - start == 1:
            out.append(rows[start][2])
        else:
            drawn = sorted((draw(), i) for _, _, i in rows[start:end])
            out.extend(i for _, i in drawn)
        start = end
    return out[:k]


def _minus_score(s: Scored) -> float:
    return -s.score


def _tie_key(
    loads: dict[str, float], tiebreak: dict[str, float]
) -> Callable[[Scored], tuple[float, float, float]]:
    def key(s: Scored) -> tuple[float, float, float]:
        return (-s.score, loads[s.replica], tiebreak[s.replica])

    return key


def _softmax_pick(ordered: list[Scored], temperature: float, rng: random.Random) -> Scored:
    top = ordered[0].score
    weights = [math.exp((s.score - top) / temperature) for s in ordered]
    return rng.choices(ordered, weights=weights, k=1)[0]


# --- dispatch -------------------------------------------------------------------------------


def decide(
    policy: Policy,
    cands: Sequence[Candidate],
    keys: Sequence[int],
    w: Weights,
    *,
    session: str | None,
    turns: Iterator[int],
    rng: random.Random,
    top_k: int | None = None,
    distrusted: Collection[str] = (),
) -> Decision:
    """Every candidate scored by ``policy``, ranked, the best ``top_k`` kept (None or 0: all)."""
    if policy is Policy.KV_AWARE:
        scored = kv_aware(cands, len(keys), w, distrusted=distrusted)
    elif policy is Policy.LEAST_LOAD:
        scored = least_load(cands, w)
    elif policy is Policy.SESSION_AFFINITY:
        if session is None:
            raise ScoringError("session: required by the session_affinity policy")
        scored = rendezvous(cands, session.encode(), "session_hash")
    elif policy is Policy.PREFIX_HASH:
        scored = rendezvous(cands, prefix_key(keys, w), "prefix_hash")
    elif policy is Policy.ROUND_ROBIN:
        chosen = cands[next(turns) % len(cands)].replica if cands else None
        scored = constant(cands, chosen, "round_robin")
    else:
        chosen = rng.choice(cands).replica if cands else None
        scored = constant(cands, chosen, "random")
    return rank(scored, cands, w, rng, top_k)
