"""Each stream's prefix match → ``POST /query``'s answer, in tokens: a rank's GPU match is its
leading blocks on GPU, its CPU match the leading ones on GPU or CPU, its disk match all of them
(any tier); an instance shows the longest of its ranks' on each tier."""

from __future__ import annotations

from collections.abc import Mapping

from kvindex.api.dynamo.instances import rank_of
from kvindex.api.dynamo.schemas import InstanceOverlap, Overlap
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.index.protocol import PrefixMatch


def leading(tiers: tuple[Tier, ...], worst: Tier) -> int:
    """How many leading blocks sit on ``worst`` or a better tier."""
    for i, tier in enumerate(tiers):
        if tier > worst:
            return i
    return len(tiers)


def overlap(matches: Mapping[StreamId, PrefixMatch], block_size: int) -> Overlap:
    """The answer for the streams' matches (streams without a block are left out)."""
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, InstanceOverlap] = {}
    gpu_blocks: list[int] = []
    for stream, match in sorted(matches.items()):
        if not match.tiers:
            continue
        instance, rank = rank_of(stream)
        gpu = leading(match.tiers, Tier.GPU)
        cpu = leading(match.tiers, Tier.CPU)
        total = len(match.tiers)
        key = str(instance)
        seen = instances.get(key)
        if seen is None:
            seen = instances[key] = InstanceOverlap(0, 0, {}, 0, 0)
        seen.dp[str(rank)] = gpu * block_size
        seen.gpu = max(seen.gpu, gpu * block_size)
        seen.cpu = max(seen.cpu, cpu * block_size)
        seen.disk = max(seen.disk, total * block_size)
        seen.longest_matched = seen.disk
        if gpu:
            scores.setdefault(key, {})[str(rank)] = gpu * block_size
            gpu_blocks.append(gpu)
    return Overlap(scores, frequencies(gpu_blocks), instances)


def frequencies(gpu_blocks: list[int]) -> list[int]:
    """How many ranks hold each leading block on GPU (as many entries as the longest match)."""
    ending = [0] * (max(gpu_blocks, default=0) + 1)
    for num_blocks in gpu_blocks:
        ending[num_blocks] += 1
    counts, held = [], len(gpu_blocks)
    for num_ending in ending[:-1]:
        held -= num_ending
        counts.append(held)
    return counts
