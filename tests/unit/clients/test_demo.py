"""The demo's time model: vLLM's step, as the replica scheduler takes it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvindex.clients.demo import DemoError, DemoSettings, first_token_times
from kvindex.clients.fake_vllm.scheduler import STEP_BASE_S, STEP_PER_TOKEN_S


def step(tokens: int) -> float:
    return STEP_BASE_S + STEP_PER_TOKEN_S * tokens


def model(
    uncached: Sequence[int], max_tokens: int, max_running: int = 4, budget: int = 2048
) -> tuple[list[float], list[bool]]:
    """(times to first token, waited) of ``uncached``."""
    times = first_token_times(uncached, max_tokens, max_running, budget)
    return [t for t, _ in times], [w for _, w in times]


def test_one_request_alone_takes_one_step_to_its_first_token() -> None:
    ttfts, waited = model([300], 8)
    assert ttfts == pytest.approx([step(300)]) and waited == [False]


def test_requests_admitted_together_share_the_step_not_a_queue() -> None:
    """Both prefills run in the first step: its time grows with both prompts, and neither
    waits for the other to finish."""
    ttfts, waited = model([300, 500], 8)
    assert ttfts == pytest.approx([step(800)] * 2) and waited == [False, False]


def test_a_long_prefill_is_chunked_and_running_decodes_go_first() -> None:
    """A prompt over the budget spans steps; the request admitted first decodes in each."""
    ttfts, waited = model([100, 3000], 4)
    # step 1: 100 + 1948 of 3000; step 2: one decode token + the last 1052
    assert ttfts == pytest.approx([step(2048), step(2048) + step(1053)])
    assert waited == [False, False]


def test_a_request_past_max_running_waits_for_a_slot() -> None:
    """The third waits until one of the first two has sampled all its tokens."""
    ttfts, waited = model([100, 100, 100], 3, max_running=2)
    finish = step(200) + 2 * step(2)  # the prefill step samples one token, two decode steps
    assert ttfts == pytest.approx([step(200), step(200), finish + step(100)])
    assert waited == [False, False, True]


def test_a_fully_cached_prompt_still_computes_a_token() -> None:
    ttfts, _ = model([0], 1, max_running=1, budget=16)
    assert ttfts == pytest.approx([step(1)])


def test_settings_refuse_a_model_that_cannot_run() -> None:
    with pytest.raises(DemoError, match="max_running"):
        DemoSettings(max_running=0)
    with pytest.raises(DemoError, match="max_batched_tokens"):
        DemoSettings(max_batched_tokens=0)
