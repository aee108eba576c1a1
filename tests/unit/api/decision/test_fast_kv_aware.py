"""kvindex.api.decision.fast_kv_aware: the holders' credits equal the policy's own."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvindex.api.decision.fast_kv_aware import _minus_scores
from kvindex.api.decision.policies import Weights, tier_credit
from kvindex.indexer.domain.events import Tier
from kvindex.indexer.fleet.registry import Freshness
from kvindex.indexer.index.protocol import OnGpu, PrefixMatch

_WEIGHT = st.floats(0, 10) | st.sampled_from([0.0, 1e-300, 3.0])


@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.booleans(), st.sampled_from(list(Freshness))),
        max_size=12,
    ),
    st.integers(0, 40),
    _WEIGHT,
    _WEIGHT,
    _WEIGHT,
    _WEIGHT,
)
def test_credits_equal_tier_credit_whatever_the_tiers_type(
    held: list[tuple[int, bool, Freshness]],
    num_blocks: int,
    cache: float,
    gpu: float,
    cpu: float,
    other: float,
) -> None:
    weights = Weights(cache=cache, gpu=gpu, cpu=cpu, other=other)
    matches = {
        f"r{i}": PrefixMatch(OnGpu((Tier.GPU,) * n) if typed else (Tier.GPU,) * n)
        for i, (n, typed, _) in enumerate(held)
    }
    states = {f"r{i}": state for i, (_, _, state) in enumerate(held)}
    credit_of: dict[str, tuple[float, float]] = {}
    position = {f"r{i}": i for i in range(len(held))}
    penalties = [0.25] * len(held)
    minus = _minus_scores(
        penalties,
        matches,
        states,
        position=position,
        credit_of=credit_of,
        num_blocks=num_blocks,
        weights=weights,
    )
    for replica, match in matches.items():
        expected = tier_credit(match.tiers, states[replica], num_blocks, weights)
        assert repr(credit_of[replica]) == repr(expected)  # the same floats, bit for bit
        assert repr(minus[position[replica]]) == repr(0.25 - expected[0])
