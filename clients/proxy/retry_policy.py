"""The retry policy: at most ``max_attempts`` replicas, the next after a retried status, a
connect error or a connection that ended before any byte, after a jittered exponential
back-off; a kept-alive one closed before any byte is first retried on a new one, same replica."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TypeVar

import httpx

from kvindex.clients.proxy.connections import NothingReceivedError
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

    @staticmethod
    def again_on_new_connection(exc: Exception) -> bool:
        """Kept-alive, ended before any byte (most likely closed idle): not the replica's fault."""
        return isinstance(exc, NothingReceivedError) and exc.reused and not exc.abandoned

    @staticmethod
    def retries_error(exc: Exception) -> bool:
        """A failure before the answer's head that the next replica may retry: no connection,
        or one that ended before any byte of the answer (nothing can have reached the client)."""
        return isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | NothingReceivedError)

    def backoff_s(self, number: int) -> float:
        """Seconds to wait before attempt ``number`` (1-based; 0 before the first)."""
        if number <= 1:
            return 0.0
        settings = self._settings
        ceiling = min(settings.retry_backoff_max_s, settings.retry_backoff_s * 2 ** (number - 2))
        return self._rng.uniform(ceiling / 2, ceiling)
