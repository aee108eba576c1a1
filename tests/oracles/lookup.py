"""The references of ``kvindex.indexer.native._lookup``'s read-path loops, in Python.

Production runs the compiled loops; ``tests/unit/indexer/native/test_lookup.py`` holds each
equal to its reference here, and ``tests/unit/api/test_score_equivalence.py`` answers whole
requests with these in place of the compiled ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvindex.api.decision.policies import Weights
from kvindex.api.load.model import CountedLoad
from kvindex.indexer.index.protocol import HeldRuns, PrefixMatch

Matches = dict[str, PrefixMatch]


def best_matches(
    runs: HeldRuns, replica_of: list[str], rank_of: list[int], unique: bool
) -> tuple[Matches, dict[str, int]]:
    """Each replica's best match over its streams (the longest; a tie: the lowest rank) and
    that rank when it is not 0; ``unique`` only spares the compiled loop its compares."""
    matches: Matches = {}
    ranks: dict[str, int] = {}
    for match, run in runs:
        num_blocks = len(match.tiers)
        if not num_blocks:
            continue
        for i in run:
            replica, rank = replica_of[i], rank_of[i]
            best = matches.get(replica)
            if best is not None:
                most = len(best.tiers)
                if num_blocks < most or (num_blocks == most and rank > ranks.get(replica, 0)):
                    continue
            matches[replica] = match
            if rank:
                ranks[replica] = rank
            elif best is not None:
                ranks.pop(replica, None)
    return matches, ranks


def contenders(
    runs: HeldRuns,
    position_of: list[int],
    replica_of: list[str],
    *,
    matches: Matches,
    penalties: list[float],
    per_block: float,
    threshold: float,
) -> Matches:
    """Each replica with a holder stream whose penalty less ``per_block`` per block of its
    match is within ``threshold``, with its best match."""
    out: Matches = {}
    for match, run in runs:
        if not match.tiers:  # no match: none of its streams holds anything
            continue
        most = per_block * len(match.tiers)
        for i in run:
            if penalties[position_of[i]] - most <= threshold:
                out.setdefault(replica_of[i], matches[replica_of[i]])
    return out


def load_penalties(
    replicas: Sequence[str], counted: Mapping[str, CountedLoad], now: float, w: Weights
) -> list[float]:
    """:func:`kvindex.api.decision.policies.load_penalty` of each replica's counted load (its
    age as of ``now``), in the order of ``replicas``, with the compiled loop's arithmetic."""
    w_in_flight, w_tokens, half_life = w.in_flight, w.in_flight_tokens, w.load_half_life_s
    w_waiting, w_running, w_routed, w_kv = w.waiting, w.running, w.routed, w.kv_usage
    out: list[float] = []
    for replica in replicas:
        c = counted.get(replica)
        if c is None:
            out.append(w_in_flight * 0.0 + w_tokens * 0.0)
            continue
        load, routed, (num_requests, num_tokens) = c
        first_hand = w_in_flight * num_requests
        prefill = w_tokens * num_tokens
        if load is None:
            out.append(first_hand + prefill)
            continue
        age = now - load.ts
        recency = 0.5 ** ((0.0 if age < 0.0 else age) / half_life) if half_life else 1.0
        queue = (w_waiting * load.waiting + w_running * load.running) * recency
        queue += w_routed * routed
        queue = queue if queue > first_hand else first_hand
        out.append(queue + w_kv * load.kv_usage * recency + prefill)
    return out
