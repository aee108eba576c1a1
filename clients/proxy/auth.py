"""The inbound bearer token: who may use the proxy."""

from __future__ import annotations

import secrets
from collections.abc import Mapping

from kvindex.indexer.domain.errors import KvIndexError

OPEN_PATHS = frozenset({"/health", "/healthz", "/readyz"})


class UnauthorizedError(KvIndexError):
    """The request lacks the proxy's bearer token, or has another one (401)."""


class InboundAuth:
    def __init__(self, token: str | None) -> None:
        self._expected = None if token is None else f"Bearer {token}".encode()

    def check(self, path: str, headers: Mapping[str, str]) -> None:
        """UnauthorizedError unless ``path`` is open or ``headers`` (lower case) carry the token."""
        if self._expected is None or path in OPEN_PATHS:
            return
        given = headers.get("authorization", "").encode("latin-1", "replace")
        if not secrets.compare_digest(given, self._expected):
            raise UnauthorizedError("missing or wrong bearer token")
