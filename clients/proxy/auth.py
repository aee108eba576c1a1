"""The inbound bearer token: who may use the proxy, decided on the normal form of the path
(:func:`.routes.normal_path`), so no spelling of a guarded route (``/metrics/``,
``//metrics``, ``/./metrics``) is open.

The ``Authorization`` value is read as RFC 9110 §11 defines credentials: the scheme
``Bearer`` in any case, one or more spaces, the token exactly (whitespace around the value
is not part of it, §5.5: the server has stripped it). More than one ``Authorization``
header is refused: which one counts would be a guess."""

from __future__ import annotations

import secrets
from collections.abc import Mapping

from starlette.datastructures import Headers

from kvindex.clients.proxy.routes import normal_path
from kvindex.indexer.domain.errors import KvIndexError

OPEN_PATHS = frozenset({"/health", "/healthz", "/readyz"})


class UnauthorizedError(KvIndexError):
    """The request lacks the proxy's bearer token, or has another one (401)."""


def is_open(path: str) -> bool:
    """``path`` is a probe's, however spelled (a trailing ``/`` included)."""
    normal = normal_path(path)
    return normal in OPEN_PATHS or normal.removesuffix("/") in OPEN_PATHS


class InboundAuth:
    def __init__(self, token: str | None) -> None:
        self._expected = None if token is None else token.encode()
        self.guards = token is not None
        """A token is asked for (False: :meth:`check` lets everything through)."""

    def check(self, path: str, headers: Mapping[str, str]) -> None:
        """UnauthorizedError unless ``path`` is open or ``headers`` (lower case; starlette's
        :class:`Headers` when repeats matter) carry the token."""
        if self._expected is None or is_open(path):
            return
        if isinstance(headers, Headers):
            given = headers.getlist("authorization")
        else:
            given = [headers["authorization"]] if "authorization" in headers else []
        if len(given) != 1 or not secrets.compare_digest(_token(given[0]), self._expected):
            raise UnauthorizedError("missing or wrong bearer token")


def _token(value: str) -> bytes:
    """The token of a ``Bearer`` credential (b"": another scheme, or none)."""
    scheme, _, rest = value.strip(" \t").partition(" ")
    if scheme.lower() != "bearer":
        return b""
    return rest.lstrip(" ").encode("latin-1", "replace")
