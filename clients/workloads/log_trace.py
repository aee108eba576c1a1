"""A tokenized request log as a trace: at its timestamps, or Poisson at ``rate``."""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvindex.clients.workloads.trace import TraceRequest, WorkloadError, poisson_arrivals

if TYPE_CHECKING:  # the reader pulls in the tokenizers; a trace needs none
    from kvindex.clients.workloads.request_log import TokenizedRequest

DEFAULT_LOG_RATE = 20.0
"""Arrivals/s of a request log whose requests lack timestamps (and no rate was given)."""
DEFAULT_OUTPUT_TOKENS = 256
"""Output tokens of a logged request without ``max_tokens``."""


def logged_trace(
    requests: Sequence[TokenizedRequest], *, rate: float | None = None, seed: int = 0
) -> list[TraceRequest]:
    """The logged requests as the simulator replays them, sorted by arrival."""
    if not requests:
        raise WorkloadError("the request log has no usable request")
    if rate is not None and not rate > 0:
        raise WorkloadError(f"rate must be > 0, got {rate}")
    stamps = [r.request.timestamp_s for r in requests]
    if rate is None and all(s is not None for s in stamps):
        first = min(s for s in stamps if s is not None)
        arrivals = [s - first for s in stamps if s is not None]
    else:
        gaps = poisson_arrivals(random.Random(seed), rate or DEFAULT_LOG_RATE)
        arrivals = [t for t, _ in zip(gaps, requests, strict=False)]
    out = [_logged(r, t) for r, t in zip(requests, arrivals, strict=True)]
    out.sort(key=lambda r: r.arrival_s)
    return out


def _logged(done: TokenizedRequest, arrival_s: float) -> TraceRequest:
    request = done.request
    output = request.max_tokens if request.max_tokens is not None else DEFAULT_OUTPUT_TOKENS
    prompt = array("I", done.tokens)  # 4 bytes a token, not a list's 36
    return TraceRequest(arrival_s, len(prompt), output, request.conversation(), prompt)
