"""kvindex.clients.workloads.log_trace."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest

from kvindex.clients.workloads.log_trace import (
    DEFAULT_LOG_RATE,
    DEFAULT_OUTPUT_TOKENS,
    logged_trace,
)
from kvindex.clients.workloads.request_log import LoggedRequest, TokenizedRequest
from kvindex.clients.workloads.trace import WorkloadError


def _logged(
    stamps: Sequence[float | None], max_tokens: int | None = None
) -> list[TokenizedRequest]:
    return [
        TokenizedRequest(
            LoggedRequest(i + 1, "m", prompt="p", timestamp_s=t, max_tokens=max_tokens),
            [i + 1] * 40,
        )
        for i, t in enumerate(stamps)
    ]


def test_a_logged_trace_arrives_at_its_timestamps_sorted() -> None:
    trace = logged_trace(_logged([1_000.5, 1_000.0, 1_002.0]))
    assert [r.arrival_s for r in trace] == [0.0, 0.5, 2.0]
    assert [r.tokens()[0] for r in trace] == [2, 1, 3]
    assert all(r.output_length == DEFAULT_OUTPUT_TOKENS for r in trace)
    assert [r.session for r in trace] == ["line:2", "line:1", "line:3"]


def test_a_logged_trace_without_every_timestamp_or_with_a_rate_is_poisson() -> None:
    trace = logged_trace(_logged([1.0, None] * 200, max_tokens=9), seed=3)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(trace)]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / DEFAULT_LOG_RATE, rel=0.3)
    assert trace[0].output_length == 9 and trace[0].input_length == 40
    fast = logged_trace(_logged([1.0] * 400), rate=1000.0)
    assert fast[-1].arrival_s < 1.0


def test_a_logged_trace_needs_requests_and_a_positive_rate() -> None:
    with pytest.raises(WorkloadError, match="no usable request"):
        logged_trace([])
    with pytest.raises(WorkloadError, match="rate"):
        logged_trace(_logged([1.0]), rate=0.0)
