"""kvindex.clients.proxy.headers: hop-by-hop dropped (RFC 9110 §7.6.1), the client appended
to X-Forwarded-For and Forwarded, values kept byte for byte, control characters refused."""

from __future__ import annotations

import os
import uuid

import pytest

from kvindex.clients.proxy.headers import (
    HEADER_ENCODING,
    REQUEST_ID,
    BadHeaderError,
    forwarded_headers,
    request_id_of,
)


def test_headers_named_by_connection_and_proxy_connection_are_dropped() -> None:
    inbound = [
        ("Connection", "keep-alive, X-Secret-Hop"),
        ("connection", "x-other"),
        ("x-secret-hop", "1"),
        ("X-Other", "2"),
        ("proxy-connection", "keep-alive"),
        ("x-kept", "3"),
    ]
    sent = forwarded_headers(inbound, "rid", ("10.0.0.9", 5555))
    names = [n.lower() for n, _ in sent]
    assert names == ["x-kept", "x-forwarded-for", "forwarded", REQUEST_ID]


def test_the_client_is_appended_to_what_it_sent() -> None:
    inbound = [
        ("X-Forwarded-For", "203.0.113.7"),
        ("x-forwarded-for", " 198.51.100.2 "),
        ("Forwarded", "for=203.0.113.7"),
    ]
    sent = dict(forwarded_headers(inbound, "rid", ("127.0.0.1", 4000), "https"))
    assert sent["x-forwarded-for"] == "203.0.113.7, 198.51.100.2, 127.0.0.1"
    assert sent["forwarded"] == "for=203.0.113.7, for=127.0.0.1;proto=https"
    v6 = dict(forwarded_headers([], "rid", ("::1", 4000)))
    assert (v6["x-forwarded-for"], v6["forwarded"]) == ("::1", 'for="[::1]";proto=http')


def test_values_keep_the_clients_bytes() -> None:
    utf8 = "José".encode().decode(HEADER_ENCODING)  # as the server hands it over
    sent = dict(forwarded_headers([("x-user", utf8), ("x-tab", "a\tb")], "rid"))
    assert sent["x-user"].encode(HEADER_ENCODING) == "José".encode()
    assert sent["x-tab"] == "a\tb"


@pytest.mark.parametrize("value", ["a\x00b", "a\x01", "a\x7f", "a\x1bb"])
def test_control_characters_are_refused(value: str) -> None:
    with pytest.raises(BadHeaderError, match="x-bad"):
        forwarded_headers([("x-bad", value)], "rid")


def test_a_made_request_id_is_a_fresh_uuid4() -> None:
    made = [request_id_of([]) for _ in range(1000)]
    assert len(set(made)) == len(made)
    for value in made:
        parsed = uuid.UUID(hex=value)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122 and parsed.hex == value


def test_a_forked_worker_makes_other_request_ids_than_its_parent() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, to the parent
        os.write(write, request_id_of([]).encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.waitpid(pid, 0)
    os.close(read)
    assert child != request_id_of([])
