"""Where a request may go: its path normalised before routing, and the routes passed through.

:func:`normal_path` is the one form the proxy routes on and forwards: backslashes read as
``/``, ``//`` runs merged, dot segments removed (RFC 3986 §5.2.4) after percent-decoding, so
no spelling of ``..`` climbs out of ``/v1/``. Only :data:`PASSTHROUGH_ROUTES` (and
``proxy.extra_routes``, :func:`is_plain_route`: e.g. vLLM's ``/tokenize``) reach a replica
untouched by the proxy."""

from __future__ import annotations

import re

from kvindex.indexer.domain.errors import KvIndexError

# Chat, completions and models are the proxy's own routes.
PASSTHROUGH_ROUTES = frozenset({"/v1/embeddings", "/v1/responses"})
CONFINED_TO = "/v1/"
OWN_ROUTES = frozenset(
    {"/health", "/healthz", "/readyz", "/metrics", "/v1/models"}
    | {"/v1/chat/completions", "/v1/completions"}
)
"""The routes the proxy answers itself: never passed through."""
_SLASHES = re.compile(r"/{2,}")
_PLAIN = re.compile(r"(/[A-Za-z0-9_.~-]+)+")


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


def is_plain_route(route: str) -> bool:
    """``route`` may be passed through: an absolute path of plain segments, in normal form,
    not one the proxy answers itself (nor under ``/v1/models``)."""
    if not _PLAIN.fullmatch(route) or normal_path(route) != route:
        return False
    return route not in OWN_ROUTES and not route.startswith("/v1/models/")
