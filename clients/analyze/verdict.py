"""The verdict: which routing policy the traffic calls for, why, and what to do first: the
fix first when it recovers more than routing could; ``least_load`` for short or unique
prompts; ``prefix_hash`` when a few shared prefixes spread the load; else ``kv_aware``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MIN_CEILING = 0.2
"""Below this single-cache ceiling, cache-aware routing cannot pay: ``least_load``."""
SHORT_PROMPT_TOKENS = 128
"""Prompts shorter than this on average prefill in a few milliseconds: ``least_load``."""
PREFIX_HASH_SHARE = 0.8
"""``prefix_hash`` needs a ``prefix_blocks`` that keeps this share of the reusable tokens..."""
MAX_GROUP_SHARE = 0.5
"""...and sends no more than this share of the requests to one replica."""


@dataclass(frozen=True, slots=True)
class Evidence:
    num_requests: int
    prompt_tokens: int
    ceiling: float
    ceiling_after_fix: float
    best_fix: float
    """recoverable_fraction of the best fragmentation finding (0: none)."""
    best_fix_text: str
    largest_group_by_blocks: Sequence[float]
    hit_blocks: Sequence[int]


@dataclass(frozen=True, slots=True)
class Verdict:
    policy: str
    reason: str
    recommendations: list[str] = field(default_factory=list)
    prefix_blocks: int | None = None
    """Blocks ``prefix_hash`` should hash (None: nothing is reusable)."""


def decide(e: Evidence) -> Verdict:
    """The verdict on the traffic as logged; the fix first when it would pay more."""
    fit = _prefix_fit(e)
    policy, reason = _policy(e, fit)
    prefix_blocks = fit[0] if fit else None
    steps: list[str] = []
    fix = _fix_step(e)
    if fix and e.best_fix > e.ceiling:
        steps.append(fix)
    steps.append(_route_step(policy, prefix_blocks))
    if fix and e.best_fix <= e.ceiling:
        steps.append(fix)
    steps.append(
        "measure the hit rate before and after each change: kvindex simulate --request-log LOG"
    )
    return Verdict(policy, reason, steps, prefix_blocks)


def _prefix_fit(e: Evidence) -> tuple[int, float, float] | None:
    """(prefix_blocks, share kept, largest group's share) of the longest prefix_blocks that
    keeps :data:`PREFIX_HASH_SHARE` of the reusable tokens."""
    total = sum(e.hit_blocks)
    if not total:
        return None
    kept_by_blocks = [0] * (max(e.hit_blocks) + 1)
    for hits in e.hit_blocks:
        kept_by_blocks[hits] += hits
    kept = 0
    for blocks in range(len(kept_by_blocks) - 1, 0, -1):
        kept += kept_by_blocks[blocks]
        if kept / total >= PREFIX_HASH_SHARE:
            largest = e.largest_group_by_blocks[blocks - 1]
            return blocks, kept / total, largest
    return None  # unreachable: at one block every reusable token is kept


def _policy(e: Evidence, fit: tuple[int, float, float] | None) -> tuple[str, str]:
    mean_tokens = e.prompt_tokens / e.num_requests if e.num_requests else 0.0
    if e.ceiling < MIN_CEILING or fit is None:
        return "least_load", (
            f"only {e.ceiling:.0%} of prompt tokens are in blocks an earlier request had:"
            " cache-aware routing cannot pay, route by load"
        )
    if mean_tokens < SHORT_PROMPT_TOKENS:
        return "least_load", (
            f"prompts are short ({mean_tokens:.0f} tokens on average): their prefill is cheap,"
            " route by load"
        )
    blocks, kept, largest = fit
    if largest <= MAX_GROUP_SHARE:
        return "prefix_hash", (
            f"hashing the first {blocks} blocks keeps {kept:.0%} of the reusable tokens"
            f" (requests that share them go to one replica) and sends at most {largest:.0%}"
            " of the requests to one replica"
        )
    return "kv_aware", (
        f"{e.ceiling:.0%} of prompt tokens are reusable, but the first {blocks} blocks"
        f" that hold them are shared by {largest:.0%} of the requests (hashing them would"
        " load one replica): route by where the blocks are and by load"
    )


def _fix_step(e: Evidence) -> str:
    if not e.best_fix_text:
        return ""
    return (
        f"fix the prompt structure: {e.best_fix_text}; moved after the shared content it would"
        f" make {e.best_fix:.0%} more of the prompt tokens cacheable (ceiling {e.ceiling:.0%}"
        f" → {e.ceiling_after_fix:.0%}); then analyze again"
    )


def _route_step(policy: str, prefix_blocks: int | None) -> str:
    if policy == "least_load":
        return "route with least_load: skip cache-aware routing for this traffic"
    if policy == "prefix_hash":
        return f"route with prefix_hash, weights prefix_blocks={prefix_blocks}"
    hint = f" (prefix_hash would need prefix_blocks={prefix_blocks})" if prefix_blocks else ""
    return f"route with kv_aware{hint}"
