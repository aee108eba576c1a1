"""The inbound bearer token: who may use the proxy."""

from __future__ import annotations

import secrets
from collections.abc import Mapping

from kvindex.indexer.domain.errors import KvIndexError

OPEN_PATHS = frozenset({"/health", "/healthz", "/readyz"})
"""Routes a probe reaches without the token (they say nothing but up or ready)."""


class UnauthorizedError(KvIndexError):
    """The request lacks the proxy's bearer token, or has another one (401)."""


class InboundAuth:
    """Checks the bearer token of requests (``token`` None: every request passes)."""

    def __init__(self, token: str | None) -> None:
        self._expected = None if token is None else f"Bearer {token}".encode()

    def check(self, path: str, headers: Mapping[str, str]) -> None:
        """Raise :class:`UnauthorizedError` unless ``path`` is open or ``headers`` (names
        in lower case) carry the token."""
        if self._expected is None or path in OPEN_PATHS:
            return
        given = headers.get("authorization", "").encode("latin-1", "replace")
        if not secrets.compare_digest(given, self._expected):
            raise UnauthorizedError("missing or wrong bearer token")
