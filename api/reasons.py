"""A decision and its ``/score`` answer's parts (:class:`Decided`), and a ranking's reasons
(:class:`Reasons`): kept as read, worded only when asked, as :meth:`Scorer.score` words it.

Reference: :meth:`kvindex.api.score.Scorer.score`;
tests/unit/api/test_reasons.py::test_reasons_answer_as_the_scorer_on_random_fleets"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

import msgspec

from kvindex.api.answer import entry
from kvindex.api.decision.candidates import Seen
from kvindex.api.decision.policies import Decision, Policy, Scored, Weights, kv_aware
from kvindex.api.decision.routing_rules import RoutingRule
from kvindex.api.lookup.matches import Lookup
from kvindex.api.schemas import ScoreResponse
from kvindex.api.tokenize.protocol import Head


class Decided(msgspec.Struct, frozen=True, gc=False):
    """One request's decision and what its answer is made of (a Struct, not tracked by the GC)."""

    decision: Decision
    seen: Seen
    policy: Policy
    weights: Weights
    rule: RoutingRule | None
    unhealthy: dict[str, str]
    degraded: str | None
    block_size: int
    num_tokens: int
    num_blocks: int
    num_candidates: int
    num_matched: int
    distrusted: Collection[str]
    worded: bool
    """The decision's entries carry their terms (False: the lean ``kv_aware``'s scores alone)."""
    head: Head | None = None
    """Decided on the prompt's head: ``num_tokens`` estimated, the whole owed."""


def response_of(
    model: str, made: Decided, scored: Sequence[Scored], weights: dict[str, float]
) -> ScoreResponse:
    """``/score``'s answer of ``made``, its ranked entries ``scored`` (terms worded)."""
    seen, block_size = made.seen, made.block_size
    return ScoreResponse(
        model=model,
        block_size=block_size,
        num_tokens=made.num_tokens,
        num_blocks=made.num_blocks,
        best=made.decision.best,
        policy=made.policy.value,
        weights=weights,
        scores=[entry(seen, s, block_size) for s in scored],
        num_candidates=made.num_candidates,
        num_matched=made.num_matched,
        degraded=made.degraded,
        rule=made.rule.name if made.rule is not None else None,
        unhealthy=made.unhealthy,
    )


class Explains(Protocol):
    """Something that words a decision as ``/score`` would answer it (:class:`Reasons`)."""

    def answer(self) -> ScoreResponse: ...


class Reasons(msgspec.Struct, frozen=True, gc=False):
    """A decision of ``model`` whose reads were kept for its ranked candidates alone (small:
    not the fleet's), worded when read; immutable once made."""

    model: str
    made: Decided
    weights: dict[str, float] | None = None
    """``made.weights`` as a dict when the scorer has it made already (never changed)."""

    def answer(self) -> ScoreResponse:
        """The answer :meth:`~kvindex.api.score.Scorer.score` gives of the same decision."""
        made = self.made
        scored = made.decision.ranked
        if not made.worded:  # the lean kv_aware path: its terms are kv_aware's (held equal)
            cands = [made.seen.candidate(s.replica) for s in scored]
            scored = kv_aware(cands, made.num_blocks, made.weights, None, made.distrusted)
        weights = made.weights.as_dict() if self.weights is None else dict(self.weights)
        return response_of(self.model, made, scored, weights)


def kept_reads(seen: Seen, scored: Sequence[Scored]) -> Seen:
    """What ``seen`` (one decision's reads) holds of the ``scored`` candidates: each read no
    larger than their number (one as small already is kept whole)."""
    lookup, loads, statuses = seen.lookup, seen.loads, seen.statuses
    matches, ranks = lookup.matches, lookup.ranks
    kept, num_kept = [s.replica for s in scored], len(scored)
    if len(matches) > num_kept:
        matches = {r: matches[r] for r in kept if r in matches}
    if len(ranks) > num_kept:
        ranks = {r: ranks[r] for r in kept if r in ranks}
    if len(loads) > num_kept:
        loads = {r: loads[r] for r in kept if r in loads}
    if len(statuses) > num_kept:
        statuses = {r: statuses[r] for r in kept if r in statuses}
    return Seen(Lookup(matches=matches, ranks=ranks), loads, statuses, seen.now)
