"""kvindex.api.reasons: a ranking's reasons, worded when read, are :meth:`Scorer.score`'s answer.

Two scorers of one seed on one random fleet (data-parallel ranks, stale and replaying
streams, CPU tiers, missing loads, ties, requests in flight), every request a dry run so
neither weighs on the other: one answers ``score`` with ``top_k`` lowered to the bound, the
other ranks with ``explain`` and words its reasons afterwards; the answers are equal, field
for field (terms, freshness views, loads, counts)."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from kvindex.api.load.model import Load
from kvindex.api.reasons import Reasons
from kvindex.api.schemas import ScoreRequest, ScoreResponse
from kvindex.api.score import Scorer
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.domain.health import StreamReport
from tests.unit.api.test_score_equivalence import MODEL, NOW, TOKENS, RandomFleet

POLICIES = [None, "kv_aware", "least_load", "round_robin", "random"]


def _request(
    top_k: int | None, policy: str | None, weights: dict[str, float] | None
) -> ScoreRequest:
    return ScoreRequest(
        model=MODEL, token_ids=TOKENS, top_k=top_k, policy=policy, weights=weights, dry_run=True
    )


def _reasons(scorer: Scorer, request: ScoreRequest, explain: int) -> Reasons:
    ranking = asyncio.run(scorer.ranking(request, explain=explain))
    assert isinstance(ranking.reasons, Reasons)
    return ranking.reasons


def _scored(scorer: Scorer, request: ScoreRequest, explain: int) -> ScoreResponse:
    """``score``'s answer with ``top_k`` lowered to ``explain`` (what a ranking keeps)."""
    top_k = scorer.top_k(request)
    bounded = explain if top_k is None else min(top_k, explain)
    return asyncio.run(scorer.score(msgspec.structs.replace(request, top_k=bounded)))


@pytest.mark.parametrize("seed", range(80))
def test_reasons_answer_as_the_scorer_on_random_fleets(seed: int) -> None:
    rng = random.Random(seed)
    fleet = RandomFleet(seed)
    distrusted = frozenset(s.id for s in fleet.specs if rng.random() < 0.3)
    policy = rng.choice(POLICIES)
    weights = rng.choice([None, {"temperature": 0.5}, {"cache": 3.0, "cpu": 1.2}])
    top_k = rng.choice([None, 0, 1, 2, 3, 1_000])
    explain = rng.choice([1, 2, 4, 8])
    request = _request(top_k, policy, weights)
    answers = fleet.scorer(seed, distrusted=distrusted)
    rankings = fleet.scorer(seed, distrusted=distrusted)
    for _ in range(2):
        expected = _scored(answers, request, explain)
        ranking = asyncio.run(rankings.ranking(request, explain=explain))
        assert ranking.reasons is not None
        assert ranking.reasons.answer() == expected
        assert ranking.ranked == tuple((e.replica, e.matched_tokens) for e in expected.scores)


@pytest.mark.parametrize("seed", range(20))
def test_reasons_are_the_decisions_reads_not_the_fleet_later(seed: int) -> None:
    """Worded after the fleet changed (loads, streams gone stale, the clock on), the reasons
    still say what the decision read; they keep the kept candidates' reads alone."""
    fleet = RandomFleet(seed)
    clock = [NOW]
    scorer = fleet.scorer(seed, clock=lambda: clock[0])
    reasons = _reasons(scorer, _request(None, None, None), explain=3)
    before = reasons.answer()
    for spec in fleet.specs:
        fleet.loads.put(spec.id, Load(50.0, 50.0, 1.0, NOW + 5, "push"))
        fleet.registry.record(StreamId(spec.id, 0), StreamReport(replaying=True))
    clock[0] = NOW + 100
    assert reasons.answer() == before
    kept = reasons.made.seen
    assert len(before.scores) <= 3 and not kept.lookup.runs
    for reads in (kept.lookup.matches, kept.lookup.ranks, kept.loads, kept.statuses):
        assert len(reads) <= len(before.scores)  # never the fleet's


def test_a_ranking_without_explain_has_no_reasons() -> None:
    fleet = RandomFleet(1)
    ranking = asyncio.run(fleet.scorer(1).ranking(_request(None, None, None)))
    assert ranking.reasons is None
