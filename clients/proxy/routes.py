"""Where a request may go: its path normalised before routing, and the routes passed through.

:func:`normal_path` is the one form the proxy routes on and forwards: backslashes read as
``/``, ``//`` runs merged, dot segments removed (RFC 3986 §5.2.4) after percent-decoding, so
no spelling of ``..`` climbs out of ``/v1/``. Only :data:`PASSTHROUGH_ROUTES` (and
``proxy.extra_routes``) reach a replica untouched by the proxy."""

from __future__ import annotations

import re

from kvindex.indexer.domain.errors import KvIndexError

# Chat, completions and models are the proxy's own routes.
PASSTHROUGH_ROUTES = frozenset({"/v1/embeddings", "/v1/responses"})
CONFINED_TO = "/v1/"
_SLASHES = re.compile(r"/{2,}")


class UnknownRouteError(KvIndexError):
    """A path the proxy neither serves nor passes through, or one leaving ``/v1/`` (404)."""


def normal_path(path: str) -> str:
    """``path`` (percent-decoded, as the server's scope gives it) in normal form."""
    segments = _SLASHES.sub("/", "/" + path.replace("\\", "/")).split("/")[1:]
    kept: list[str] = []
    for segment in segments:
        if segment == "..":
            if kept:
                kept.pop()
        elif segment not in (".", ""):
            kept.append(segment)
    trailing = "/" if kept and segments[-1] in ("", ".", "..") else ""
    return "/" + "/".join(kept) + trailing


def escapes(sent: str, normal: str) -> bool:
    """The client wrote a ``/v1/`` path that normalises out of it."""
    spelled = _SLASHES.sub("/", sent.replace("\\", "/"))
    return spelled.startswith(CONFINED_TO) and not normal.startswith(CONFINED_TO)
