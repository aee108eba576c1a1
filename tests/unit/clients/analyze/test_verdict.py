"""The verdict's rules, on evidence made by hand."""

from __future__ import annotations

from collections.abc import Sequence

from kvindex.clients.analyze.verdict import Evidence, decide


def evidence(
    *,
    ceiling: float,
    hit_blocks: Sequence[int],
    largest: Sequence[float],
    prompt_tokens: int = 100_000,
    best_fix: float = 0.0,
) -> Evidence:
    return Evidence(
        num_requests=100,
        prompt_tokens=prompt_tokens,
        ceiling=ceiling,
        ceiling_after_fix=ceiling + best_fix,
        best_fix=best_fix,
        best_fix_text="100 requests differ at token 5 (e.g. 'x')" if best_fix else "",
        largest_group_by_blocks=largest,
        hit_blocks=hit_blocks,
    )


def test_little_reuse_is_least_load() -> None:
    v = decide(evidence(ceiling=0.1, hit_blocks=[1] * 100, largest=[1.0, 0.1]))
    assert v.policy == "least_load" and "10%" in v.reason


def test_short_prompts_are_least_load() -> None:
    v = decide(evidence(ceiling=0.5, hit_blocks=[2] * 100, largest=[0.1] * 4, prompt_tokens=6000))
    assert v.policy == "least_load" and "short" in v.reason


def test_reuse_in_spread_prefixes_is_prefix_hash() -> None:
    v = decide(evidence(ceiling=0.7, hit_blocks=[20] * 100, largest=[0.1] * 30))
    assert (v.policy, v.prefix_blocks) == ("prefix_hash", 20)
    assert v.recommendations[0] == "route with prefix_hash, weights prefix_blocks=20"


def test_one_dominant_prefix_is_kv_aware_with_a_prefix_blocks_hint() -> None:
    largest = [1.0] * 20 + [0.01] * 10
    v = decide(evidence(ceiling=0.9, hit_blocks=[20] * 100, largest=largest))
    assert (v.policy, v.prefix_blocks) == ("kv_aware", 20)
    assert "100%" in v.reason


def test_prefix_blocks_keeps_most_of_the_reuse() -> None:
    # 80 requests reuse 10 blocks, 20 reuse 50: 50 blocks keep 1000/1800 (< 80%), 10 all.
    hits = [10] * 80 + [50] * 20
    v = decide(evidence(ceiling=0.6, hit_blocks=hits, largest=[0.05] * 60))
    assert v.prefix_blocks == 10


def test_a_fix_worth_more_than_routing_comes_first() -> None:
    v = decide(evidence(ceiling=0.05, hit_blocks=[1] * 100, largest=[1.0], best_fix=0.8))
    assert v.policy == "least_load"
    assert v.recommendations[0].startswith("fix the prompt structure")
    assert "5% → 85%" in v.recommendations[0]
    v = decide(evidence(ceiling=0.7, hit_blocks=[20] * 100, largest=[0.1] * 30, best_fix=0.05))
    assert v.recommendations[0].startswith("route with prefix_hash")
    assert v.recommendations[1].startswith("fix the prompt structure")
