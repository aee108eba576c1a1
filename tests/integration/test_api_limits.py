"""What one client can make the API hold: body size and read time, counts per /score.

In-process (``httpx.ASGITransport``) for what the app decides, and over a real uvicorn on
loopback for what a socket does: a declared body that never comes, a body too large.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import msgspec
import pytest

from kvindex.api.config.settings import ApiSettings
from kvindex.api.http.app import create_app
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.runtime import ApiDeps
from kvindex.api.schemas import MAX_BLOCK_KEYS, MAX_TOKEN_IDS
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.index.memory import MemoryIndex
from tests.integration.api_harness import MODEL, Api, open_api, serving_http
from tests.support.redis_server import free_port

SETTINGS = ApiSettings(scrape_interval_s=0, seed=7, max_body_bytes=4096, body_timeout_s=0.5)


@pytest.fixture
def api() -> Iterator[Api]:
    made = open_api(SETTINGS, MemoryIndex(), MemoryLoadStore(), blocking_store=False)
    made.fleet.add("r1")
    yield made
    made.close()


def error(response_body: bytes) -> dict[str, str]:
    decoded: dict[str, str] = msgspec.json.decode(response_body)
    return decoded


def test_a_declared_length_over_the_limit_is_413_naming_the_setting(api: Api) -> None:
    body = msgspec.json.encode({"model": MODEL, "token_ids": list(range(2000))})
    response = api.request("POST", "/score", content=body)
    assert response.status_code == 413, response.text
    assert error(response.content)["error"] == "body_too_large"
    assert "api.max_body_bytes" in error(response.content)["detail"]


def test_a_chunked_body_over_the_limit_is_413(api: Api) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "demo-model", "token_ids": [1'
        for _ in range(2000):
            yield b", 1"
        yield b"]}"

    call = api.client.post("/replicas", content=chunks())
    response = api.runner.run(call)
    assert response.status_code == 413, response.text
    assert "4096 (api.max_body_bytes)" in error(response.content)["detail"]


def test_a_body_under_the_limit_is_served(api: Api) -> None:
    assert api.score(token_ids=list(range(64))).best == "r1"


@pytest.mark.parametrize(
    ("field", "num_items", "named"),
    [
        ("token_ids", MAX_TOKEN_IDS + 1, f"length <= {MAX_TOKEN_IDS} - at `$.token_ids`"),
        ("block_keys", MAX_BLOCK_KEYS + 1, f"length <= {MAX_BLOCK_KEYS} - at `$.block_keys`"),
    ],
)
def test_too_many_tokens_or_keys_is_422_naming_the_limit(
    field: str, num_items: int, named: str
) -> None:
    settings = dataclasses.replace(SETTINGS, max_body_bytes=8 * 1024 * 1024)
    api = open_api(settings, MemoryIndex(), MemoryLoadStore(), blocking_store=False)
    try:
        response = api.post("/score", {"model": MODEL, field: [0] * num_items})
    finally:
        api.close()
    assert response.status_code == 422, response.text
    assert named in error(response.content)["detail"]


def raw_post(port: int, head: str, body: bytes = b"") -> tuple[bytes, float]:
    """Send ``head`` (and ``body``) on a fresh connection; the whole answer (until the
    server closes) and how long it took."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head.encode() + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer, time.monotonic() - started


@contextmanager
def serving(header_timeout_s: float = 0.3, body_timeout_s: float = 0.5) -> Iterator[int]:
    """The app over a real uvicorn (as ``kvindex api`` serves it) on a free port."""
    settings = dataclasses.replace(
        SETTINGS,
        port=free_port(),
        header_timeout_s=header_timeout_s,
        body_timeout_s=body_timeout_s,
    )
    deps = ApiDeps(settings, MemoryIndex(), Registry(), MemoryLoadStore(), blocking_store=False)
    with serving_http(create_app(deps), settings):
        yield settings.port


@pytest.fixture
def served_port() -> Iterator[int]:
    with serving() as port:
        yield port


def test_a_body_that_never_arrives_is_cut_after_the_body_timeout(served_port: int) -> None:
    head = "POST /score HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    answer, took = raw_post(served_port, head + "content-length: 100\r\n\r\n", b"{")
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"api.body_timeout_s" in answer
    assert 0.4 < took < 3.0


def test_a_huge_declared_length_is_refused_at_once_and_the_connection_closed(
    served_port: int,
) -> None:
    head = "POST /score HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    answer, took = raw_post(served_port, head + f"content-length: {10**11}\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert b'"error":"body_too_large"' in answer
    assert took < 1.0


def closed_after(port: int, sent: bytes, trickle: bytes = b"") -> float:
    """Send ``sent`` on a fresh connection, then one byte of ``trickle`` every 0.1 s; how
    long until the server closed it (unanswered)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(sent)
        for byte in trickle:
            sock.settimeout(0.1)
            try:
                if sock.recv(65536) == b"":
                    return time.monotonic() - started
            except TimeoutError:
                pass
            except ConnectionResetError:
                return time.monotonic() - started
            sock.sendall(bytes([byte]))
        sock.settimeout(5)
        assert sock.recv(65536) == b"", "the server answered a request it never got"
    return time.monotonic() - started


@pytest.mark.parametrize(
    ("sent", "trickle"),
    [
        (b"", b""),  # a connection that sends nothing
        (b"POST /score HTTP/1.1\r\nhost: x\r\n", b"x-slow: " + b"a" * 100),  # slowloris
    ],
    ids=["silent", "trickled"],
)
def test_a_request_head_that_never_completes_is_cut_after_the_header_timeout(
    served_port: int, sent: bytes, trickle: bytes
) -> None:
    took = closed_after(served_port, sent, trickle)
    assert 0.25 < took < 3.0, took


def test_the_header_timeout_ends_with_the_headers() -> None:
    """A body that follows its head later than ``header_timeout_s`` (within the body's
    own timeout) is read and answered: the head deadline ends with the headers."""
    head = "POST /score HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    body = b'{"model": "demo-model", "token_ids": [1, 2]}'
    with (
        serving(header_timeout_s=0.3, body_timeout_s=5.0) as port,
        socket.create_connection(("127.0.0.1", port), timeout=5) as sock,
    ):
        sock.sendall(f"{head}content-length: {len(body)}\r\n\r\n".encode())
        time.sleep(0.9)  # three header timeouts
        sock.sendall(body)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 404"), answer  # the model is unknown: answered
