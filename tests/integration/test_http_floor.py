"""What every HTTP client can read from kvindex's servers, as a user meets them.

A body too large is answered 413 after the client has sent it whole: no reset on the way
(httpx's and the openai package's trace says the body went out whole; requests has read its
body to the end). A request asking to upgrade to a protocol kvindex does not speak (h2c, as
``curl --http2`` asks; WebSocket) is served as HTTP/1.1, body and all. Real processes on free
loopback ports: ``kvindex api`` on a private Redis that a ``kvindex indexer`` registers a
replica in, ``kvindex serve``, and ``kvindex proxy`` in front of a ``kvindex replica-sim``.
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import requests

from tests.integration.test_proxy_forwarding import _start as start_proxy
from tests.support.processes import http_ok, kvindex_child
from tests.support.redis_server import free_port, running_redis

MODEL = "demo-model"
MB = 1 << 20
SIZES = [9 * MB, 135 * MB]
"""The bodies the black-box probe sent (the limit, ``api.max_body_bytes``, is 8 MiB)."""
ROUTES = ["/score", "/load", "/replicas"]
SCORE = json.dumps({"model": MODEL, "token_ids": list(range(64))}).encode()
H2C = {
    "Connection": "Upgrade, HTTP2-Settings",
    "Upgrade": "h2c",
    "HTTP2-Settings": "AAMAAABkAAQCAAAAAAIAAAAA",
}
"""What ``curl --http2`` adds to a request on ``http://``."""
WEBSOCKET = {
    "Connection": "Upgrade",
    "Upgrade": "websocket",
    "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
    "Sec-WebSocket-Version": "13",
}
pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True)
class Server:
    kind: str
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _scores(port: int) -> Callable[[], bool]:
    """Ready: ``/score`` answers 200 for MODEL (its replica is registered)."""
    return http_ok(port, "/score", "POST", SCORE)


def _replica(events_port: int) -> str:
    return f"id=r1,model={MODEL},events=tcp://127.0.0.1:{events_port}"


def start_api(stack: ExitStack, workdir: Path) -> Server:
    """``kvindex api`` on a private Redis, where ``kvindex indexer`` registers replica r1."""
    redis_url = stack.enter_context(running_redis()).url
    port, events_port = free_port(), free_port()
    indexer_args = ["indexer", "--store", "redis", "--redis-url", redis_url]
    indexer_args += ["--replica", _replica(events_port), "--status-port", "-1"]
    indexer_args += ["--stats-every", "0"]
    indexer = kvindex_child("indexer", indexer_args, workdir / "indexer.log", lambda: True)
    stack.callback(indexer.stop)
    indexer.start()
    args = ["api", "--redis-url", redis_url, "--port", str(port)]
    api = kvindex_child("api", args, workdir / "api.log", _scores(port))
    stack.callback(api.stop)
    api.start(40)
    return Server("api", port)


def start_serve(stack: ExitStack, workdir: Path, env: dict[str, str] | None = None) -> Server:
    port, events_port = free_port(), free_port()
    args = ["serve", "--replica", _replica(events_port), "--port", str(port)]
    args += ["--stats-every", "0"]
    serve = kvindex_child("serve", args, workdir / "serve.log", _scores(port))
    serve.env = env or {}
    stack.callback(serve.stop)
    serve.start(40)
    return Server("serve", port)


@pytest.fixture(scope="module", params=["api", "serve"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp(request.param)
    with ExitStack() as stack:
        start = start_api if request.param == "api" else start_serve
        yield start(stack, workdir)


@dataclass
class Sent:
    """What a client's trace says of the request body it sent (httpcore's events)."""

    events: list[str] = field(default_factory=list)

    def trace(self, name: str, _info: dict[str, Any]) -> None:
        self.events.append(name)

    def hook(self, request: httpx.Request) -> None:
        """An httpx request hook that traces ``request``."""
        request.extensions["trace"] = self.trace

    @property
    def whole(self) -> bool:
        return "http11.send_request_body.complete" in self.events


def assert_too_large(status: int, body: bytes) -> None:
    assert status == 413, body[:300]
    assert json.loads(body)["error"] == "body_too_large", body[:300]


class TrackedBody(io.BytesIO):
    """A request body as a file: ``drained`` once the client has read (sent) all of it."""

    drained = False

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.drained = self.drained or not data
        return data


def chunks(num_bytes: int, drained: list[bool]) -> Iterator[bytes]:
    """A body of ``num_bytes`` in 1 MiB chunks (sent chunked); ``drained`` gets True once the
    client asks past the last one (it has sent them all)."""
    piece = b"1" * MB
    for _ in range(num_bytes // MB):
        yield piece
    drained.append(True)


@pytest.fixture(scope="module")
def bodies() -> dict[int, bytes]:
    return {size: b"1" * size for size in SIZES}


@pytest.mark.parametrize("size", SIZES, ids=["9MB", "135MB"])
@pytest.mark.parametrize("path", ROUTES)
def test_httpx_sending_a_body_too_large_whole_reads_the_413(
    server: Server, path: str, size: int, bodies: dict[int, bytes]
) -> None:
    sent = Sent()
    with httpx.Client(base_url=server.base_url, trust_env=False, timeout=30) as client:
        response = client.post(path, content=bodies[size], extensions={"trace": sent.trace})
    assert sent.whole, sent.events  # the old build reset the connection mid-body
    assert_too_large(response.status_code, response.content)


@pytest.mark.parametrize("size", SIZES, ids=["9MB", "135MB"])
@pytest.mark.parametrize("path", ROUTES)
def test_requests_sending_a_body_too_large_whole_reads_the_413(
    server: Server, path: str, size: int, bodies: dict[int, bytes]
) -> None:
    body = TrackedBody(bodies[size])
    response = requests.post(server.base_url + path, data=body, timeout=30)
    assert body.drained  # urllib3 stops reading the body at a reset
    assert_too_large(response.status_code, response.content)


@pytest.mark.parametrize("path", ROUTES)
def test_a_chunked_body_growing_too_large_is_read_whole_then_413(server: Server, path: str) -> None:
    drained: list[bool] = []
    response = requests.post(server.base_url + path, data=chunks(40 * MB, drained), timeout=30)
    assert drained == [True]
    assert_too_large(response.status_code, response.content)
    sent = Sent()
    with httpx.Client(base_url=server.base_url, trust_env=False, timeout=30) as client:
        answer = client.post(path, content=chunks(40 * MB, []), extensions={"trace": sent.trace})
    assert sent.whole, sent.events
    assert_too_large(answer.status_code, answer.content)


@pytest.mark.parametrize("size", SIZES, ids=["9MB", "135MB"])
def test_the_openai_package_sending_a_body_too_large_reads_the_413(
    server: Server, size: int, bodies: dict[int, bytes]
) -> None:
    sent = Sent()
    http_client = openai.DefaultHttpxClient(trust_env=False, event_hooks={"request": [sent.hook]})
    with (
        openai.OpenAI(
            base_url=server.base_url, api_key="unused", max_retries=0, http_client=http_client
        ) as client,
        pytest.raises(openai.APIStatusError) as refused,
    ):
        client.post("/score", cast_to=httpx.Response, content=bodies[size])
    assert sent.whole, sent.events
    assert_too_large(refused.value.status_code, refused.value.response.content)


def _post(port: int, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    """POST with ``headers`` on one connection; then ``GET /healthz`` on it: the
    connection is still a plain HTTP/1.1 one."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("POST", path, body, {"content-type": "application/json", **headers})
        response = connection.getresponse()
        answer = response.status, response.read()
        connection.request("GET", "/healthz")
        assert connection.getresponse().status == 200
        return answer
    finally:
        connection.close()


@pytest.mark.parametrize("upgrade", [H2C, WEBSOCKET], ids=["h2c", "websocket"])
def test_a_post_asking_to_upgrade_is_served_with_its_body(
    server: Server, upgrade: dict[str, str]
) -> None:
    status, body = _post(server.port, "/score", SCORE, upgrade)
    assert status == 200, body  # the old build lost the body: 422 "Input data was truncated"
    assert json.loads(body)["best"] == "r1"


def test_a_chunked_post_asking_for_h2c_is_served_with_its_body(server: Server) -> None:
    head = "".join(f"{name}: {value}\r\n" for name, value in H2C.items())
    sent = (
        f"POST /score HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{head}"
        "transfer-encoding: chunked\r\n\r\n"
    ).encode()
    sent += b"%x\r\n%s\r\n0\r\n\r\n" % (len(SCORE), SCORE)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(sent)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200 OK"), answer[:300]


def test_the_proxy_serves_a_chat_asking_for_h2c_with_its_body(tmp_path: Path) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with ExitStack() as stack:
        _, proxy = start_proxy(stack, tmp_path, {"r1": []})
        status, body = _post(proxy.port, "/v1/chat/completions", json.dumps(chat).encode(), H2C)
        assert status == 200, body  # the old build: 400, the body lost
        assert json.loads(body)["choices"]
        sent = Sent()
        with httpx.Client(base_url=proxy.base_url, trust_env=False, timeout=30) as client:
            response = client.post(
                "/v1/chat/completions", content=b"1" * 135 * MB, extensions={"trace": sent.trace}
            )
        assert sent.whole, sent.events
        assert response.status_code == 413, response.text


def test_a_client_that_never_stops_sending_is_cut_after_the_body_timeout(
    tmp_path: Path,
) -> None:
    """The drain after a 413 is bounded: ``api.body_timeout_s`` (here 1 s) at most, however
    fast the client goes on sending."""
    with ExitStack() as stack:
        server = start_serve(stack, tmp_path, {"KVINDEX_API_BODY_TIMEOUT_S": "1"})
        head = f"POST /score HTTP/1.1\r\nhost: x\r\ncontent-length: {10**12}\r\n\r\n"
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(head.encode())
            answer = sock.recv(65536)
            started = time.monotonic()
            with pytest.raises((BrokenPipeError, ConnectionResetError)):
                while time.monotonic() - started < 8:
                    sock.sendall(b"1" * 65536)
            took = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert 0.7 < took < 4, took


DEEP = 100_000
"""The nesting the black-box probe sent (msgspec's depth guard stops far sooner)."""


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/score", b'{"model": "m", "token_ids": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
        ("/score", b'{"model": "m", "salt": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
        ("/load", b'{"replica": "r1", "running": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
        ("/replicas", b'{"id": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
    ],
    ids=["score-token_ids", "score-field", "load", "replicas"],
)
def test_a_body_nested_too_deep_is_a_4xx_not_a_500(server: Server, path: str, body: bytes) -> None:
    answer = httpx.post(
        f"{server.base_url}{path}",
        content=body,
        headers={"content-type": "application/json"},
        trust_env=False,
    )
    assert 400 <= answer.status_code < 500, (answer.status_code, answer.text[:300])
    assert "error" in answer.json()


def test_a_request_the_parser_refuses_gets_the_apis_json_400(server: Server) -> None:
    sent = b"POST /score HTTP/1.1\r\nhost: x\r\nx-bad: a\x00b\r\ncontent-length: 2\r\n\r\n{}"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(sent)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), answer[:300]
    assert b"content-type: application/json" in head.lower(), head
    assert json.loads(body) == {
        "error": "invalid_request",
        "detail": "Invalid HTTP request received.",
    }


READYZ_SPELLINGS = [
    ("GET", "/readyz", b""), ("HEAD", "/readyz", b""), ("POST", "/readyz", b"{}"),
    ("DELETE", "/readyz", b""), ("GET", "/readyz/", b""), ("GET", "//readyz", b""),
    ("GET", "/./readyz", b""), ("GET", "/x/../readyz", b""), ("GET", "/readyz?x=%zz", b""),
    ("GET", "/readyz", b"{not json"), ("GET", "/readyz/../score", b""),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "body"), READYZ_SPELLINGS)
def test_readyz_answered_by_the_server_protocol_is_never_a_5xx_nor_a_reset(
    server: Server, method: str, path: str, body: bytes
) -> None:
    """``/readyz`` is answered in the server's protocol (no FastAPI): any method, spelling or
    body gets an answer below 500 on a connection that goes on serving."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        connection.putrequest(method, path, skip_accept_encoding=True)
        connection.putheader("content-length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        status, _ = response.status, response.read()
        connection.request("GET", "/healthz")
        assert connection.getresponse().status == 200
    finally:
        connection.close()
    assert status < 500
