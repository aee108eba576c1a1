"""Reference: kvindex.api.decision.policies.decide; tests/unit/api/test_score_equivalence.py::test_the_lean_kv_aware_answer_equals_the_plain_one_on_random_fleets

``kv_aware`` without a temperature, equal to it (``best``, scores, terms, draws) at one load
penalty per candidate at most: cache terms for holders that may rank, terms for the ``top_k``.
"""  # noqa: E501

from __future__ import annotations

import random
from collections.abc import Collection

from kvindex.api.decision.candidates import Seen, by_replica, states
from kvindex.api.decision.penalty_floors import PenaltyFloors, Walk, pays
from kvindex.api.decision.policies import (
    Decision,
    Scored,
    Weights,
    distrusted_credit,
    kv_aware,
    load_penalties,
    tier_credit,
)
from kvindex.api.decision.top_k import best, contenders
from kvindex.api.load.store import LoadChanges
from kvindex.api.lookup.matches import Matches, RankedStreams
from kvindex.indexer.fleet.registry import Freshness, RegistryView
from kvindex.indexer.index.protocol import OnGpu, PrefixMatch

MAX_FLOORS = 8
"""Weights whose penalty floors are kept."""
_STALE, _LIVE, _PARTIAL = Freshness.STALE, Freshness.LIVE, Freshness.PARTIAL


class FastKvAware:
    """One scorer's ``kv_aware`` decisions, on its event loop (``changes`` None: no floors)."""

    def __init__(self, registry: RegistryView, changes: LoadChanges | None) -> None:
        self._registry = registry
        self._changes = changes
        self._floors: dict[Weights, PenaltyFloors] = {}
        self._last_floors: tuple[Weights, PenaltyFloors] | None = None

    def decide(
        self,
        ranked: list[str],
        streams: RankedStreams,
        seen: Seen,
        *,
        num_blocks: int,
        top_k: int | None,
        weights: Weights,
        rng: random.Random,
        explain: bool = True,
        distrusted: Collection[str] = (),
        gather: bool = False,
    ) -> Decision:
        """The decision over ``ranked``; fills ``seen.statuses`` for the ``top_k`` chosen.
        ``explain`` False: the same order and scores, no terms, ``seen.statuses`` left empty
        unless ``gather`` (what would explain the chosen, read now: :mod:`kvindex.api.reasons`)."""
        matches, streams_of = seen.lookup.matches, streams.streams_of
        walk = self._penalties(ranked, streams, seen, weights, top_k)
        if isinstance(walk, list):
            penalties = bounds = walk
            positions, threshold = None, None
        else:  # floors under the others' penalties bound the contenders as well
            penalties, positions, threshold = walk.penalties, walk.positions, walk.kth
            bounds = walk.bounds()
        held_by = contenders(
            seen.lookup,
            bounds,
            streams,
            top_k=top_k,
            num_blocks=num_blocks,
            weights=weights,
            threshold=threshold,
        )
        if not isinstance(walk, list):
            walk.complete(map(streams.position.__getitem__, held_by))
        # Gathering for every candidate (each one ranks): all their streams read at once.
        everyone = gather and not explain and (top_k is None or top_k >= len(ranked))
        if everyone:
            held = self._registry.freshness(streams.streams)
        else:
            held = self._registry.freshness([s for r in held_by for s in streams_of.get(r, ())])
        credit_of: dict[str, tuple[float, float]] = {}
        minus_scores = _minus_scores(
            penalties,
            held_by,
            states(held),
            position=streams.position,
            credit_of=credit_of,
            num_blocks=num_blocks,
            weights=weights,
            distrusted=distrusted,
        )
        order = best(minus_scores, penalties, rng, top_k, positions)
        winners = [ranked[i] for i in order]
        if everyone:
            seen.statuses.update(by_replica(held))
        elif explain or gather:
            chosen = set(winners)
            seen.statuses.update(by_replica([s for s in held if s.stream.replica in chosen]))
            rest = [s for r in winners if r not in matches for s in streams_of.get(r, ())]
            seen.statuses.update(by_replica(self._registry.freshness(rest)))
        if not explain:
            plain = [Scored(r, -minus_scores[i], {}) for r, i in zip(winners, order, strict=True)]
            return Decision(winners[0] if winners else None, plain)
        cands = [seen.candidate(r) for r in winners]
        credits = [credit_of.get(r) for r in winners]
        scored = kv_aware(cands, num_blocks, weights, credits, distrusted)
        assert all(s.score == -minus_scores[i] for s, i in zip(scored, order, strict=True))
        return Decision(winners[0] if winners else None, scored)

    def _penalties(
        self,
        ranked: list[str],
        streams: RankedStreams,
        seen: Seen,
        weights: Weights,
        top_k: int | None,
    ) -> list[float] | Walk:
        """The load penalties the answer needs: from kept floors when they pay, else all."""
        changes, version = self._changes, seen.version
        if changes is None or version is None or not pays(len(ranked), top_k):
            return load_penalties(ranked, seen.loads, seen.now, weights)
        assert top_k is not None
        kept, loads = self._floors, seen.loads
        last = self._last_floors  # the same weights object as the last answer's: no hashing
        floors = last[1] if last is not None and last[0] is weights else kept.get(weights)
        if floors is not None and floors.holds(ranked, seen.now):
            changed = changes.changed_since(floors.version)
            if changed is None or not floors.note_changed(
                changed, streams.position, loads, version
            ):
                floors = None
        else:
            floors = None
        if floors is None:
            floors = PenaltyFloors(ranked, weights, loads, now=seen.now, version=version)
            kept.pop(weights, None)
            if len(kept) >= MAX_FLOORS:
                del kept[next(iter(kept))]  # the weights least recently made again
            kept[weights] = floors
        self._last_floors = (weights, floors)
        return floors.walk(loads, seen.now, top_k)


def _minus_scores(
    penalties: list[float],
    matches: Matches,
    freshness_of: dict[str, Freshness],
    *,
    position: dict[str, int],
    credit_of: dict[str, tuple[float, float]],
    num_blocks: int,
    weights: Weights,
    distrusted: Collection[str] = (),
) -> list[float]:
    """Each candidate's ``kv_aware`` score, negated; the holders' (credit, factor) go into
    ``credit_of`` (no freshness record: stale), undiscounted (``distrusted``: discounted here)."""
    minus_scores = penalties.copy()
    # Credit per (match, freshness): the holders of one prefix share its match object, and
    # come one after another (the last pair is checked first: no hashing).
    credits: dict[tuple[int, str], tuple[float, float]] = {}
    last: tuple[PrefixMatch, Freshness, tuple[float, float]] | None = None
    state_of = freshness_of.get
    no_cpu, no_other = weights.cpu * 0, weights.other * 0  # tier_credit's zero terms
    for replica, match in matches.items():
        i, state = position[replica], state_of(replica, _STALE)
        if last is not None and last[0] is match and last[1] is state:
            credit = last[2]
        elif type(match.tiers) is OnGpu and (state is _LIVE or state is _PARTIAL) and num_blocks:
            # tier_credit's arithmetic for tiers all on GPU at a factor of 1.0, inlined
            weighted = (weights.gpu * len(match.tiers) + no_cpu + no_other) / num_blocks
            credit = (weights.cache * weighted * 1.0, 1.0)
            last = (match, state, credit)
        else:  # keyed by the state's value: an enum member hashes in Python
            key = (id(match), state._value_)  # the matches live until the answer is made
            known = credits.get(key)
            if known is None:
                known = credits[key] = tier_credit(match.tiers, state, num_blocks, weights)
            credit = known
            last = (match, state, credit)
        credit_of[replica] = credit
        cache = credit[0]
        if distrusted and replica in distrusted:
            cache = distrusted_credit(cache, weights)
        minus_scores[i] = penalties[i] - cache  # == -(credit - penalty), exactly
    return minus_scores
