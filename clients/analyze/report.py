"""The report of ``kvindex analyze``: every figure, built from a finished cache walk."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvindex.clients.analyze.cache_walk import CacheWalk
from kvindex.clients.analyze.fragmentation import (
    MIN_RECOVERABLE_FRACTION,
    MIN_REQUESTS,
    FragmentGroup,
    common_prefix,
    varying_texts,
)
from kvindex.clients.analyze.prefixes import SharedPrefix
from kvindex.clients.analyze.verdict import Evidence, Verdict, decide
from kvindex.clients.workloads.request_log import LogProblem

TOP_PREFIXES = 10
TOP_FINDINGS = 10
EXAMPLES_SHOWN = 3
PROFILE_POINTS = 64
"""Buckets of block positions in ``cacheable_by_position``."""

Decode = Callable[[str, list[int]], Awaitable[str]]  # (model, token ids) -> text


@dataclass(frozen=True, slots=True)
class Finding:
    token_offset: int
    """Where the varying text starts (of the first request that has it)."""
    requests: int
    """Requests sharing the content after it (the first one included)."""
    varying_text: list[str]
    recoverable_tokens: int
    recoverable_fraction: float
    """Share of all prompt tokens the fix makes cacheable."""


@dataclass(frozen=True, slots=True)
class PrefixRow:
    tokens: int
    requests: int
    share: float
    """Share of the requests that have this prefix."""
    start: str
    """The prefix's first tokens, decoded."""


@dataclass(frozen=True, slots=True)
class ProfilePoint:
    token_offset: int
    cacheable: float
    cacheable_after_fix: float


@dataclass(frozen=True, slots=True)
class AnalysisReport:
    source: str
    block_size: int
    num_requests: int
    prompt_tokens: int
    cached_fraction_ceiling: float
    """Share of prompt tokens in blocks some earlier request had (one unbounded cache)."""
    cached_fraction_after_fix: float
    """The same with every finding's span moved after the shared content."""
    fragmentation: list[Finding]
    top_prefixes: list[PrefixRow]
    verdict: Verdict
    cacheable_by_position: list[ProfilePoint]
    num_problems: int
    problems: list[str]
    """The first skipped lines, each with its number and why."""
    wall_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def build_report(
    walk: CacheWalk,
    decode: Decode,
    *,
    source: str,
    problems: tuple[int, list[LogProblem]],
) -> AnalysisReport:
    """The report of ``walk`` (finished); ``decode`` shows examples and prefix starts."""
    total = max(walk.prompt_tokens, 1)
    findings = await _findings(walk, decode)
    counts = walk.prefixes.counts()
    prefixes = counts.shared_prefixes()
    best = findings[0] if findings else None
    evidence = Evidence(
        num_requests=walk.num_requests,
        prompt_tokens=walk.prompt_tokens,
        ceiling=walk.cached_tokens / total,
        ceiling_after_fix=(walk.cached_tokens + walk.recoverable_tokens) / total,
        best_fix=best.recoverable_fraction if best else 0.0,
        best_fix_text=_where(best),
        largest_group_by_blocks=counts.largest_group_by_blocks(),
        hit_blocks=walk.hit_blocks,
    )
    return AnalysisReport(
        source=source,
        block_size=walk.block_size,
        num_requests=walk.num_requests,
        prompt_tokens=walk.prompt_tokens,
        cached_fraction_ceiling=evidence.ceiling,
        cached_fraction_after_fix=evidence.ceiling_after_fix,
        fragmentation=findings,
        top_prefixes=[await _row(walk, p, decode) for p in prefixes[:TOP_PREFIXES]],
        verdict=decide(evidence),
        cacheable_by_position=_profile(walk),
        num_problems=problems[0],
        problems=[str(p) for p in sorted(problems[1], key=lambda p: p.line)],
    )


def _where(finding: Finding | None) -> str:
    if finding is None:
        return ""
    example = finding.varying_text[0] if finding.varying_text else ""
    return (
        f"{finding.requests} requests differ at token {finding.token_offset}"
        f" (e.g. {example.strip()[:60]!r}) before content they share"
    )


async def _findings(walk: CacheWalk, decode: Decode) -> list[Finding]:
    total = max(walk.prompt_tokens, 1)
    groups = [
        g
        for g in walk.finder.groups.values()
        if g.members + 1 >= MIN_REQUESTS
        and g.recoverable_tokens / total >= MIN_RECOVERABLE_FRACTION
    ]
    groups.sort(key=lambda g: -g.recoverable_tokens)
    return [await _finding(walk, g, decode, total) for g in groups[:TOP_FINDINGS]]


async def _finding(walk: CacheWalk, group: FragmentGroup, decode: Decode, total: int) -> Finding:
    spans = [span for _, span in group.examples]
    model = walk.models[group.examples[0][0]]
    texts = varying_texts([await decode(model, span) for span in spans])
    shown = list(dict.fromkeys(t for t in texts if t))[:EXAMPLES_SHOWN]
    return Finding(
        token_offset=group.base + common_prefix(spans),
        requests=group.members + 1,
        varying_text=shown,
        recoverable_tokens=group.recoverable_tokens,
        recoverable_fraction=group.recoverable_tokens / total,
    )


async def _row(walk: CacheWalk, prefix: SharedPrefix, decode: Decode) -> PrefixRow:
    tokens = prefix.blocks * walk.block_size
    start = walk.starts[prefix.example][:tokens].tolist()
    return PrefixRow(
        tokens=tokens,
        requests=prefix.requests,
        share=prefix.requests / walk.num_requests,
        start=await decode(walk.models[prefix.example], start),
    )


def _profile(walk: CacheWalk) -> list[ProfilePoint]:
    profile = walk.profile
    used = int((profile.tokens > 0).sum())
    if not used:
        return []
    width = -(-used // PROFILE_POINTS)  # block positions per point, rounded up
    points = []
    for first in range(0, used, width):
        tokens = int(profile.tokens[first : first + width].sum())
        cached = int(profile.cached[first : first + width].sum())
        fixed = int(profile.cached_after_fix[first : first + width].sum())
        if tokens:
            points.append(ProfilePoint(first * walk.block_size, cached / tokens, fixed / tokens))
    return points
