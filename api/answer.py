"""A ``/score`` answer's entries: each ranked candidate explained, its match by tier and its
freshness."""

from __future__ import annotations

from collections.abc import Sequence

from kvindex.api.decision.candidates import Seen, freshness
from kvindex.api.decision.policies import Scored
from kvindex.api.schemas import FreshnessView, LoadView, ScoreEntry
from kvindex.indexer.domain.events import Tier
from kvindex.indexer.fleet.registry import Freshness, StreamFreshness
from kvindex.indexer.index.protocol import NO_MATCH, gpu_count

DEGRADED_REASONS = ("index_unavailable", "fleet_unreadable", "no_healthy_candidate")
"""Why an answer can be ``degraded`` (the label of ``kvindex_degraded_answers``)."""


def entry(seen: Seen, scored: Scored, block_size: int) -> ScoreEntry:
    replica = scored.replica
    match = seen.lookup.matches.get(replica, NO_MATCH)
    load_view = None
    counted = seen.loads.get(replica)
    load = counted.load if counted is not None else None
    if counted is not None and load is not None:
        age = max(0.0, seen.now - load.ts)
        numbers = (load.running, load.waiting, load.kv_usage)
        load_view = LoadView(*numbers, age, load.source, counted.routed)
    return ScoreEntry(
        replica=replica,
        rank=seen.lookup.ranks.get(replica, 0),
        matched_blocks=match.num_blocks,
        matched_tokens=match.num_blocks * block_size,
        tiers=tier_counts(match.tiers),
        load=load_view,
        freshness=freshness_view(seen.statuses.get(replica, ()))[1],
        terms=scored.terms,
        score=scored.score,
    )


_TIER_NAMES = tuple((tier, tier.name.lower()) for tier in Tier)


def tier_counts(tiers: tuple[Tier, ...]) -> dict[str, int]:
    """Matched blocks by tier name."""
    num_gpu = gpu_count(tiers)
    if num_gpu == len(tiers):
        return {"gpu": num_gpu, "cpu": 0, "other": 0}
    return {name: tiers.count(tier) for tier, name in _TIER_NAMES}


def freshness_view(statuses: Sequence[StreamFreshness]) -> tuple[Freshness, FreshnessView]:
    """Its least fresh stream's state, its largest lag, its shortest silence, and the view
    partial longest (reason, since), if any."""
    # ``_value_`` is ``value`` without the enum property's cost.
    if len(statuses) == 1:  # one stream (no data parallelism): the replica's view is its own
        status = statuses[0]
        state = status.freshness
        view = FreshnessView(state._value_, status.lag_s, status.silent_s)
        if status.partial is not None:
            view.partial, view.partial_since = status.partial, status.partial_since
        return state, view
    state = freshness(statuses)
    lags = [s.lag_s for s in statuses if s.lag_s is not None]
    silent = [s.silent_s for s in statuses if s.silent_s is not None]
    partial = sorted((s.partial_since or 0.0, s.partial) for s in statuses if s.partial)
    view = FreshnessView(
        state=state._value_,
        lag_s=max(lags) if lags else None,
        silent_s=min(silent) if silent else None,
        partial=partial[0][1] if partial else None,
        partial_since=partial[0][0] if partial else None,
    )
    return state, view
