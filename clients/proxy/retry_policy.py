"""The retry policy: at most ``max_attempts`` replicas, the next after a retried status or a
connect error, after a jittered exponential back-off."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TypeVar

from kvindex.clients.proxy.settings import ProxySettings

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
T = TypeVar("T")


class RetryPolicy:
    """The attempts of one proxy; ``rng`` draws the jitter (seed it in tests)."""

    def __init__(self, settings: ProxySettings, rng: random.Random | None = None) -> None:
        self._settings = settings
        self._rng = rng or random.Random()

    def attempts(self, upstreams: Sequence[T]) -> Sequence[T]:
        return upstreams[: self._settings.max_attempts]

    @staticmethod
    def retries_status(status: int) -> bool:
        return status in RETRY_STATUSES

    def backoff_s(self, number: int) -> float:
        """Seconds to wait before attempt ``number`` (1-based; 0 before the first)."""
        if number <= 1:
            return 0.0
        settings = self._settings
        ceiling = min(settings.retry_backoff_max_s, settings.retry_backoff_s * 2 ** (number - 2))
        return self._rng.uniform(ceiling / 2, ceiling)
