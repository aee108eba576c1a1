"""The best ``top_k`` of a ``kv_aware`` answer without a pass per candidate: the holders
that can rank (:func:`contenders`) and the ranking itself (:func:`best`), both compiled."""

from __future__ import annotations

import random

from kvindex.api.decision.policies import Weights
from kvindex.api.lookup.matches import Lookup, Matches, RankedStreams
from kvindex.indexer.native import _lookup

_best_tied = _lookup.best_tied
_kth_smallest = _lookup.kth_smallest
_contenders = _lookup.contenders


def best(
    minus_scores: list[float],
    penalties: list[float],
    rng: random.Random,
    top_k: int | None,
    positions: list[int] | None = None,
) -> list[int]:
    """Indices of the best ``top_k`` (None: all), in ``policies.rank``'s order."""
    return _best_tied(minus_scores, penalties, rng.random, top_k, positions)


def contenders(
    lookup: Lookup,
    penalties: list[float],
    streams: RankedStreams,
    *,
    top_k: int | None,
    num_blocks: int,
    weights: Weights,
    threshold: float | None = None,
) -> Matches:
    """The matched replicas that may be among the best ``top_k``, with their best match."""
    matches = lookup.matches
    if top_k is None or top_k >= len(penalties) or not matches or num_blocks <= 0:
        return matches
    w = weights
    factor = max(1.0, w.replaying_factor, w.stale_factor)
    per_block = w.cache * max(w.gpu, w.cpu, w.other) * factor / num_blocks
    per_block = per_block * (1.0 + 1e-9) + 1e-300  # above any rounding of the real credit
    if threshold is None:
        threshold = _kth_smallest(penalties, top_k)
    return _contenders(
        lookup.runs,
        streams.position_of,
        streams.replica_of,
        matches,
        penalties,
        per_block,
        threshold,
    )
