"""The head a request asking to upgrade is parsed again with: the ask gone, nothing else.

The protocol itself is tested over real sockets (``tests/integration/test_server_protocol.py``
and ``tests/integration/test_http_floor.py``).
"""

from __future__ import annotations

import httptools
import pytest

from kvindex.api.http.request_head import _without_upgrade


@pytest.mark.parametrize(
    ("connection", "kept"),
    [
        (b"Upgrade, HTTP2-Settings", b"HTTP2-Settings"),
        (b"upgrade", b""),
        (b"keep-alive, Upgrade", b"keep-alive"),
        (b"close,UPGRADE , te", b"close, te"),
        (b"keep-alive", b"keep-alive"),
    ],
)
def test_the_upgrade_token_leaves_connection_and_the_rest_stays(
    connection: bytes, kept: bytes
) -> None:
    assert _without_upgrade(connection) == kept


class _Head:
    """Parser callbacks that keep nothing (only whether the parser upgrades matters)."""


def _upgrades(head: bytes) -> bool:
    parser = httptools.HttpRequestParser(_Head())
    try:
        parser.feed_data(head + b"\r\n")
    except httptools.HttpParserUpgrade:
        return True
    return False


def test_without_its_upgrade_header_or_token_a_head_does_not_upgrade() -> None:
    """What the protocol relies on: llhttp upgrades only on both together."""
    asked = b"POST / HTTP/1.1\r\nconnection: upgrade\r\nupgrade: h2c\r\ncontent-length: 0\r\n"
    assert _upgrades(asked)
    assert not _upgrades(asked.replace(b"upgrade: h2c\r\n", b""))
    assert not _upgrades(asked.replace(b"connection: upgrade\r\n", b""))
