"""The headers of a forwarded request: the request id kept or made, and what is not
forwarded to a replica (hop-by-hop, ``host``, ``content-length``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable

REQUEST_ID = "x-request-id"
REPLICA_HEADER = "x-kvindex-replica"
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length"}


def request_id_of(headers: Iterable[tuple[str, str]]) -> str:
    for name, value in headers:
        if name.lower() == REQUEST_ID and value:
            return value
    return uuid.uuid4().hex


def forwarded_headers(headers: Iterable[tuple[str, str]], request_id: str) -> list[tuple[str, str]]:
    dropped = _NOT_FORWARDED | {REQUEST_ID}
    kept = [(n, v) for n, v in headers if n.lower() not in dropped]
    return [*kept, (REQUEST_ID, request_id)]
