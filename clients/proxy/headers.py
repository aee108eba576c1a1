"""The headers of a forwarded request: the request id kept or made, hop-by-hop ones (RFC 9110
§7.6.1), ``host`` and ``content-length`` dropped, the client's address appended to
``X-Forwarded-For`` and ``Forwarded`` (RFC 7239). Values go on byte for byte as sent (UTF-8
included, RFC 9110 §5.5); one with a control character other than a tab is refused (400)."""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterable

from kvindex.indexer.domain.errors import KvIndexError

REQUEST_ID = "x-request-id"
REPLICA_HEADER = "x-kvindex-replica"
FORWARDED_FOR = "x-forwarded-for"
FORWARDED = "forwarded"
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", REQUEST_ID}
_REWRITTEN = frozenset({FORWARDED_FOR, FORWARDED})
"""Sent on with the client appended (:func:`_appended`), in place of the client's own."""
_DROPPED = _NOT_FORWARDED | _REWRITTEN
_random = random.Random()
os.register_at_fork(after_in_child=_random.seed)  # a worker's ids are not its parent's
_UUID4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48)) & ((1 << 128) - 1)
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
HEADER_ENCODING = "latin-1"
"""How the forwarder turns the values back into the bytes the client sent."""


class BadHeaderError(KvIndexError):
    """A request header whose value holds a control character (400)."""


def request_id_of(headers: Iterable[tuple[str, str]]) -> str:
    for name, value in headers:
        if name.lower() == REQUEST_ID and value:
            return value
    return new_request_id()


def new_request_id() -> str:
    """A version-4 UUID's hex from a generator the OS seeds once a process: unique, not secret."""
    bits = _random.getrandbits(128) & _UUID4_CLEAR | _UUID4_SET
    return f"{bits:032x}"


def forwarded_headers(
    headers: Iterable[tuple[str, str]],
    request_id: str,
    client: tuple[str, int] | None = None,
    scheme: str = "http",
) -> list[tuple[str, str]]:
    """What a replica is sent: ``headers`` less the hop-by-hop ones (those the
    ``Connection`` header names too), the request id, and ``client`` (its address; None:
    ``unknown``) appended to ``X-Forwarded-For`` and ``Forwarded``; BadHeaderError."""
    received = list(headers)
    if _CONTROL.search("\t".join([v for _, v in received])):  # a tab is allowed: one search
        for name, value in received:
            if _CONTROL.search(value):
                raise BadHeaderError(f"header {name!r}: a control character in its value")
    named = _named_by_connection(received)
    dropped = _DROPPED | named if named else _DROPPED
    kept = [(n, v) for n, v in received if n.lower() not in dropped]
    address = "unknown" if client is None else client[0]
    return [
        *kept,
        (FORWARDED_FOR, _appended(received, FORWARDED_FOR, address)),
        (FORWARDED, _appended(received, FORWARDED, f"for={_node(address)};proto={scheme}")),
        (REQUEST_ID, request_id),
    ]


def _named_by_connection(headers: list[tuple[str, str]]) -> set[str]:
    """The header names the ``Connection`` headers list (RFC 9110 §7.6.1)."""
    values = [v for n, v in headers if n.lower() in ("connection", "proxy-connection")]
    return {token.strip().lower() for v in values for token in v.split(",") if token.strip()}


def _appended(headers: list[tuple[str, str]], name: str, element: str) -> str:
    """Every ``name`` header's elements as the client sent them, then ``element``."""
    sent = [v.strip() for n, v in headers if n.lower() == name and v.strip()]
    return ", ".join([*sent, element])


def _node(address: str) -> str:
    """An RFC 7239 node: an IPv6 address bracketed and quoted."""
    return f'"[{address}]"' if ":" in address else address
