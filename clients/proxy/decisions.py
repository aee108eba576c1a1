"""The journal's routes: ``GET /decisions/{id}``, one receipt (404: unknown), and ``GET
/decisions?limit=N``, the newest N oldest first (the shared Stream's on the Redis store)."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from kvindex.clients.proxy.journal import MAX_ID_CHARS, Journal, JournalUnavailableError
from kvindex.indexer.domain.errors import KvIndexError

DEFAULT_LIMIT = 100
MAX_LIMIT = 100_000
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_JSON = "application/json"


class UnknownDecisionError(KvIndexError):
    """No receipt of that request id is kept (404)."""


class BadDecisionQueryError(KvIndexError):
    """A request id or a ``limit`` that cannot be looked up (400)."""


Endpoint = Callable[[Request], Awaitable[Response]]


def decision(journal: Journal) -> Endpoint:
    async def one(request: Request) -> Response:
        request_id = request.path_params["request_id"]
        if len(request_id) > MAX_ID_CHARS or _CONTROL.search(request_id):
            raise BadDecisionQueryError(
                f"request id: at most {MAX_ID_CHARS} characters, no control character"
            )
        if not journal.enabled:
            raise UnknownDecisionError("no receipts are kept (proxy.journal_entries = 0)")
        try:
            found = await journal.find(request_id)
        except JournalUnavailableError as exc:  # this proxy's own were looked at first
            raise UnknownDecisionError(f"no receipt of request {request_id!r} here; {exc}") from exc
        if found is None:
            raise UnknownDecisionError(f"no receipt of request {request_id!r} is kept")
        return Response(found, media_type=_JSON)

    return one


def decisions(journal: Journal) -> Endpoint:
    async def newest(request: Request) -> Response:
        limit = _limit(request.query_params.getlist("limit"))
        receipts = await journal.newest(limit) if journal.enabled else []
        return Response(b"[" + b",".join(receipts) + b"]", media_type=_JSON)

    return newest


def _limit(values: list[str]) -> int:
    if not values:
        return DEFAULT_LIMIT
    text = values[-1]
    if len(values) > 1 or not text.isascii() or not text.isdigit() or len(text) > 6:
        raise BadDecisionQueryError(f"limit: one whole number 1..{MAX_LIMIT}, got {values!r}")
    limit = int(text)
    if not 1 <= limit <= MAX_LIMIT:
        raise BadDecisionQueryError(f"limit: one whole number 1..{MAX_LIMIT}, got {limit}")
    return limit
