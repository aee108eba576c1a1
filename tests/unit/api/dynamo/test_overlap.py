"""Prefix matches → ``/query``'s answer."""

from __future__ import annotations

from kvindex.api.dynamo.overlap import frequencies, leading, overlap
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.index.protocol import PrefixMatch

G, C, X = Tier.GPU, Tier.CPU, Tier.OTHER


def test_leading_counts_blocks_on_a_tier_or_better() -> None:
    assert [leading((G, C, G, X), worst) for worst in (G, C, X)] == [1, 3, 4]


def test_an_instance_shows_its_best_rank_per_tier() -> None:
    matches = {
        StreamId("dynamo-3"): PrefixMatch((G, G)),
        StreamId("dynamo-3.dp1"): PrefixMatch((C, C, C)),
        StreamId("dynamo-4"): PrefixMatch(()),
    }
    answer = overlap(matches, 16)
    assert answer.scores == {"3": {"0": 32}}
    assert answer.frequencies == [1, 1]
    got = answer.instances["3"]
    assert (got.longest_matched, got.gpu, got.cpu, got.disk, got.dp) == (
        48,
        32,
        48,
        48,
        {"0": 32, "1": 0},
    )
    assert "4" not in answer.instances


def test_frequencies_count_ranks_holding_each_block() -> None:
    assert frequencies([3, 1, 2]) == [3, 2, 1]
    assert frequencies([]) == []
