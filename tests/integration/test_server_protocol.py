"""The server's hot path answers as the app does: two real servers, the same raw requests.

Twin memory-store fleets filled the same way, each app served by uvicorn on loopback: one
with the hot routes answered by the server's protocol (as ``kvindex serve`` and ``kvindex
api`` run), one with every request going to the app (the protocol without its hot routes).
Every request goes to both, in the same order, as raw bytes on a socket (so the head, the
pipelining and the connection's fate are the server's own), and the answers must agree:
status line, body, the headers a client acts on, and whether the connection stays open.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from starlette.datastructures import Headers

from kvindex.api.config.settings import ApiSettings
from kvindex.api.http.app import create_app, hot_serving
from kvindex.api.http.background import BackgroundServer
from kvindex.api.http.server_protocol import HotProtocol, hot_protocol
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.runtime import ApiDeps
from kvindex.api.schemas import MAX_TOKEN_IDS
from kvindex.indexer.index.memory import MemoryIndex
from tests.integration.api_harness import MODEL, Fleet, comparable_body, tokens

SETTINGS = ApiSettings(scrape_interval_s=0, seed=7, max_body_bytes=4096, body_timeout_s=0.5)
TOKEN = "s3cret-token"
_HEADERS = (b"content-type", b"www-authenticate", b"connection", b"server")
"""The headers that must agree (the length follows the body, whose clock fields vary)."""


@dataclass(frozen=True)
class Answer:
    status_line: bytes
    headers: dict[bytes, bytes]
    body: bytes


@dataclass(frozen=True)
class Exchange:
    answers: list[Answer]
    closed: bool
    """The server closed the connection after them."""


@dataclass(frozen=True)
class Twins:
    hot: int
    plain: int
    """Their ports."""

    @property
    def ports(self) -> tuple[int, int]:
        return self.hot, self.plain


def _serve(stack: ExitStack, settings: ApiSettings, *, hot: bool, blocking: bool) -> int:
    fleet = Fleet.over(MemoryIndex())
    fleet.add("r1", "r2", "r3")
    fleet.store("r1", tokens(1_000, 8))
    fleet.store("r2", tokens(1_000, 3))
    deps = ApiDeps(settings, fleet.index, fleet.registry, MemoryLoadStore(), blocking)
    app = create_app(deps)
    serving = hot_serving(app) if hot else None
    protocol = hot_protocol(settings.header_timeout_s, serving, linger_s=settings.body_timeout_s)
    server = stack.enter_context(BackgroundServer(app, http=protocol))
    return server.port


@contextmanager
def twins_over(settings: ApiSettings, *, blocking: bool = False) -> Iterator[Twins]:
    with ExitStack() as stack:
        hot = _serve(stack, settings, hot=True, blocking=blocking)
        yield Twins(hot, _serve(stack, settings, hot=False, blocking=blocking))


@pytest.fixture
def twins() -> Iterator[Twins]:
    with twins_over(SETTINGS) as made:
        yield made


def exchange(port: int, *parts: bytes, num_answers: int = 1, pause_s: float = 0.05) -> Exchange:
    """Send ``parts`` on a fresh connection (``pause_s`` apart); read ``num_answers``
    answers, then whether the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        for i, part in enumerate(parts):
            if i:
                time.sleep(pause_s)
            sock.sendall(part)
        reader = _Reader(sock)
        answers = [reader.answer() for _ in range(num_answers)]
        sock.settimeout(0.3)
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False
        except ConnectionResetError:
            closed = True
    return Exchange(answers, closed)


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _more(self) -> None:
        data = self.sock.recv(65536)
        assert data, f"the connection closed mid-answer: {self.buffer[:200]!r}"
        self.buffer += data

    def answer(self) -> Answer:
        while b"\r\n\r\n" not in self.buffer:
            self._more()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.split(b"\r\n")
        headers = dict(line.split(b": ", 1) for line in lines)
        length = int(headers.get(b"content-length", b"0"))
        while len(self.buffer) < length:
            self._more()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return Answer(status_line, headers, body)


def same(twins: Twins, *parts: bytes, num_answers: int = 1, pause_s: float = 0.05) -> Exchange:
    """The same exchange with both servers; assert they agree; return the hot one's."""
    hot, plain = (
        exchange(p, *parts, num_answers=num_answers, pause_s=pause_s) for p in twins.ports
    )
    assert hot.closed == plain.closed
    for mine, theirs in zip(hot.answers, plain.answers, strict=True):
        assert mine.status_line == theirs.status_line, (mine, theirs)
        assert comparable_body(mine.body) == comparable_body(theirs.body)
        for name in _HEADERS:
            assert mine.headers.get(name) == theirs.headers.get(name), name
        assert b"date" in mine.headers
    return hot


def request(
    method: str, target: str, body: bytes = b"", *, version: str = "1.1", **headers: str
) -> bytes:
    head = f"{method} {target} HTTP/{version}\r\nhost: kvindex.test\r\n"
    if body or method == "POST":
        head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
    head += "".join(f"{name.replace('_', '-')}: {value}\r\n" for name, value in headers.items())
    return (head + "\r\n").encode() + body


def score_body(**fields: object) -> bytes:
    return msgspec.json.encode({"model": MODEL} | fields)


VALID = score_body(token_ids=tokens(1_000, 8))


def test_hot_answers_equal_the_apps(twins: Twins) -> None:
    for fields in ({"token_ids": tokens(1_000, 8)}, {"block_keys": [1, 2]}, {"token_ids": [1]}):
        for _ in range(2):  # the scorers' state moves in step
            answer = same(twins, request("POST", "/score", score_body(**fields))).answers[0]
            assert answer.status_line == b"HTTP/1.1 200 OK"
    health = same(twins, request("GET", "/healthz")).answers[0]
    assert health.body == b'{"status":"ok"}'


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"", b"422"),
        (b"{not json", b"422"),
        (score_body(token_ids=[-1]), b"422"),
        (msgspec.json.encode({"model": "nope", "token_ids": [1, 2]}), b"404"),
        (score_body(token_ids=list(range(2000))), b"413"),
    ],
)
def test_hot_errors_equal_the_apps(twins: Twins, body: bytes, status: bytes) -> None:
    answer = same(twins, request("POST", "/score", body)).answers[0]
    assert answer.status_line.split()[1] == status


@pytest.mark.parametrize(
    "sent",
    [
        request("POST", "/score?x=1", VALID),
        request("POST", "/sc%6Fre", VALID),
        request("POST", "/score", VALID, version="1.0"),
        request("POST", "/score", VALID, connection="close"),
        request("GET", "/healthz", connection="close"),
        request("GET", "/healthz", b"{}"),
        request("GET", "/score"),
        request("POST", "/score", VALID, x_forwarded_for="10.0.0.1"),
    ],
    ids=["query", "escaped", "http10", "close", "health-close", "body", "405", "fwd"],
)
def test_what_the_hot_path_leaves_to_the_app_is_answered_alike(twins: Twins, sent: bytes) -> None:
    same(twins, sent)


_BROWSER = "accept: */*\r\naccept-encoding: gzip, deflate\r\nuser-agent: Python/3.11 aiohttp\r\n"


@pytest.mark.parametrize(
    "sent",
    [
        request("GET", "/healthz"),
        request("GET", "/readyz"),
        b"GET /healthz HTTP/1.1\r\n\r\n",
        f"GET /healthz HTTP/1.1\r\nHost: kvindex.test\r\n{_BROWSER}\r\n".encode(),
        request("GET", "/healthz", connection="keep-alive"),
        request("GET", "/healthz", Connection="close"),
        request("GET", "/healthz", content_length="0"),
        request("GET", "/healthz", expect="100-continue"),
        request("GET", "/healthz", upgrade="h2c", connection="Upgrade"),
        request("GET", "/healthz", x_forwarded_for="10.0.0.1"),
        request("GET", "/healthz?x=1"),
        request("GET", "/healthz", version="1.0"),
        b"get /healthz HTTP/1.1\r\nhost: kvindex.test\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nhost : kvindex.test\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nx-odd: caf\xc3\xa9\r\n\r\n",
        b"GET /healthz HTTP/1.1\nhost: kvindex.test\n\n",
    ],
    ids=[
        "health", "ready", "no-header", "aiohttp", "keep-alive", "close", "length-0", "expect",
        "upgrade", "fwd", "query", "http10", "lower-method", "space-colon", "obs-text", "bare-lf",
    ],
)  # fmt: skip
def test_bare_gets_are_answered_as_the_parser_answers_them(twins: Twins, sent: bytes) -> None:
    """Those the protocol answers before its parser, and those it leaves to the parser."""
    if not same(twins, sent).closed:  # then once more, on one connection
        same(twins, sent, sent, num_answers=2)


def _posted(head: str, body: bytes = VALID, length: str | None = None) -> bytes:
    declared = str(len(body)) if length is None else length
    return f"POST /score HTTP/1.1\r\n{head}Content-Length: {declared}\r\n\r\n".encode() + body


@pytest.mark.parametrize(
    "sent",
    [
        request("POST", "/score", VALID),
        _posted(f"Host: kvindex.test\r\ncontent-type: application/json\r\n{_BROWSER}"),
        _posted("x-spaced:   a b \t \r\nx-empty:\r\n"),
        _posted("", length=f" {len(VALID)}"),
        _posted("", length=f"0{len(VALID)}"),
        _posted("", length=f"+{len(VALID)}"),
        _posted(f"content-length: {len(VALID)}\r\n"),
        _posted("Transfer-Encoding: chunked\r\n"),
        _posted("connection: keep-alive\r\n"),
        _posted("x-odd: caf\xe9\r\n"),
        _posted("host : kvindex.test\r\n"),
        _posted("", length=str(len(VALID) + 5)) + b"GET /",
        _posted("", VALID + request("GET", "/healthz"), length=str(len(VALID))),
        _posted("").replace(b"POST", b"post", 1),
        _posted("").replace(b"HTTP/1.1", b"HTTP/1.0", 1),
        _posted("").replace(b"\r\n", b"\n"),
        _posted("").replace(b"/score", b"/healthz", 1),
        _posted("", b"{"),
        _posted("", b"", length="0"),
    ],
    ids=[
        "plain", "aiohttp", "spaced", "length-space", "length-0", "length-plus", "length-twice",
        "chunked", "keep-alive", "obs-text", "space-colon", "short", "pipelined",
        "lower-method", "http10", "bare-lf", "405", "bad-json", "empty",
    ],
)  # fmt: skip
def test_plain_posts_are_answered_as_the_parser_answers_them(twins: Twins, sent: bytes) -> None:
    """Those the protocol answers before its parser, and those it leaves to the parser."""
    num_answers = 2 if sent.endswith(request("GET", "/healthz")) else 1
    if sent.endswith(b"GET /"):  # the body's missing bytes: a 422 once the client gives up
        sent = sent[: -len(b"GET /")] + b"}" * 5
    if not same(twins, sent, num_answers=num_answers).closed:  # then once more, on one connection
        same(twins, sent, sent, num_answers=2 * num_answers)


def test_a_whole_plain_post_is_answered_without_the_parser(
    twins: Twins, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[bytes] = []
    begin = HotProtocol.on_message_begin

    def counted(protocol: HotProtocol) -> None:
        parsed.append(b"")
        begin(protocol)

    monkeypatch.setattr(HotProtocol, "on_message_begin", counted)
    aiohttp = _posted(f"Host: kvindex.test\r\ncontent-type: application/json\r\n{_BROWSER}")
    for sent in (request("POST", "/score", VALID), aiohttp, _posted("")):
        assert exchange(twins.hot, sent, sent, num_answers=2).answers[1].status_line.endswith(b"OK")
    assert not parsed
    exchange(twins.hot, _posted("x-forwarded-for: 10.0.0.1\r\n"))
    assert len(parsed) == 1


def test_a_post_expecting_100_continue_is_the_parsers(twins: Twins) -> None:
    sent = _posted("expect: 100-continue\r\n")
    hot, plain = (exchange(port, sent, num_answers=2) for port in twins.ports)
    assert [a.status_line for a in hot.answers] == [a.status_line for a in plain.answers]
    assert hot.answers[0].status_line == b"HTTP/1.1 100 Continue"


def test_bare_gets_pipelined_or_in_pieces_are_answered_in_order(twins: Twins) -> None:
    health, score = request("GET", "/healthz"), request("POST", "/score", VALID)
    answers = same(twins, health + health + score + health, num_answers=4).answers
    assert [a.status_line.split()[1] for a in answers] == [b"200"] * 4
    assert same(twins, health[:10], health[10:], health).answers[0].body == b'{"status":"ok"}'
    assert same(twins, score, health, pause_s=0.2, num_answers=2).answers[1].body.endswith(b"}")
    # A body that reads as a bare GET is the body still: the POST's (a 422), no health answer.
    posted = request("POST", "/score", health)
    head_end = posted.index(b"\r\n\r\n") + 4
    answer = same(twins, posted[:head_end], posted[head_end:], pause_s=0.2).answers[0]
    assert answer.status_line.split()[1] == b"422"


def test_a_body_sent_in_pieces_is_read_whole(twins: Twins) -> None:
    sent = request("POST", "/score", VALID)
    answer = same(twins, sent[:40], sent[40:300], sent[300:]).answers[0]
    assert answer.status_line == b"HTTP/1.1 200 OK"


def test_pipelined_requests_are_answered_in_order(twins: Twins) -> None:
    sent = [request("POST", "/score", VALID), request("GET", "/healthz"), request("GET", "/x")]
    sent += [request("POST", "/score", b"{"), request("POST", "/score", VALID)]
    answers = same(twins, b"".join(sent), num_answers=len(sent)).answers
    assert [a.status_line.split()[1] for a in answers] == [b"200", b"200", b"404", b"422", b"200"]


def test_answers_that_wait_are_pipelined_in_order() -> None:
    """A store the scorer reads off the loop: the hot answer waits, in a task."""
    sent = [request("POST", "/score", VALID), request("GET", "/healthz")]
    sent += [request("POST", "/score", score_body(token_ids=[1])), request("GET", "/readyz")]
    with twins_over(SETTINGS, blocking=True) as twins:
        answers = same(twins, b"".join(sent), num_answers=len(sent)).answers
        assert [a.status_line.split()[1] for a in answers] == [b"200"] * 4
        assert same(twins, request("POST", "/score", b"[")).answers[0].status_line[9:12] == b"422"


def test_the_token_is_checked_alike() -> None:
    body = score_body(token_ids=tokens(1_000, 8))
    with twins_over(dataclasses.replace(SETTINGS, auth_token=TOKEN)) as twins:
        refused = same(twins, request("POST", "/score", body)).answers[0]
        assert refused.status_line.startswith(b"HTTP/1.1 401")
        wrong = request("POST", "/score", body, authorization=f"Bearer {TOKEN}x")
        assert same(twins, wrong).answers[0].status_line.startswith(b"HTTP/1.1 401")
        right = request("POST", "/score", body, authorization=f"Bearer {TOKEN}")
        assert same(twins, right).answers[0].status_line == b"HTTP/1.1 200 OK"
        assert same(twins, request("GET", "/healthz")).answers[0].status_line.endswith(b"200 OK")


def test_a_body_that_never_arrives_is_408_and_closed(twins: Twins) -> None:
    head = request("POST", "/score", b"").replace(b"content-length: 0", b"content-length: 100")
    started = time.monotonic()
    answer = same(twins, head + b"{").answers[0]
    assert answer.status_line.startswith(b"HTTP/1.1 408")
    assert b"api.body_timeout_s" in answer.body
    assert 0.4 < time.monotonic() - started < 4.0


def test_a_client_that_leaves_mid_body_is_counted_alike_and_the_server_goes_on(
    twins: Twins,
) -> None:
    for port in twins.ports:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(request("POST", "/score", VALID)[:200])
    time.sleep(0.2)
    assert same(twins, request("POST", "/score", VALID)).answers[0].status_line.endswith(b"OK")
    hot, plain = (
        _requests_total(exchange(port, request("GET", "/metrics")).answers[0].body)
        for port in twins.ports
    )
    assert hot[("/score", "POST", "500")] == 1
    assert hot == plain


def test_the_traffic_metrics_agree(twins: Twins) -> None:
    for sent in (request("POST", "/score", VALID), request("POST", "/score", b"{")):
        same(twins, sent)
    same(twins, request("GET", "/healthz"), num_answers=1)
    hot, plain = (
        _requests_total(exchange(port, request("GET", "/metrics")).answers[0].body)
        for port in twins.ports
    )
    assert hot[("/score", "POST", "200")] == 1
    assert hot[("/score", "POST", "422")] == 1
    assert hot[("/healthz", "GET", "200")] == 1
    assert hot == plain


def _requests_total(text: bytes) -> dict[tuple[str, ...], float]:
    """``kvindex_http_requests_total`` by (route, method, status)."""
    prefix = "kvindex_http_requests_total{"
    found: dict[tuple[str, ...], float] = {}
    for line in text.decode().splitlines():
        if line.startswith(prefix):
            labels, value = line[len(prefix) :].split("} ")
            pairs = dict(part.split("=", 1) for part in labels.split(","))
            found[tuple(pairs[k].strip('"') for k in ("route", "method", "status"))] = float(value)
    return found


def test_an_answer_that_raises_an_unmapped_error_is_a_logged_500_and_closed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def boom(_body: bytes, _headers: Headers) -> bytes:
        raise RuntimeError("boom")

    fleet = Fleet.over(MemoryIndex())
    app = create_app(ApiDeps(SETTINGS, fleet.index, fleet.registry, MemoryLoadStore(), False))
    serving = hot_serving(app)
    assert serving is not None
    key = (b"POST", b"/score")
    failing = dataclasses.replace(serving.routes[key], answer=boom)
    protocol = hot_protocol(10.0, dataclasses.replace(serving, routes={key: failing}))
    with BackgroundServer(app, http=protocol) as server:
        sent = exchange(server.port, request("POST", "/score", VALID))
    (answer,) = sent.answers
    assert answer.status_line == b"HTTP/1.1 500 Internal Server Error"
    assert answer.body == b"Internal Server Error"
    assert sent.closed
    assert "answering POST /score failed" in caplog.text


KEEP_ALIVE_S = 0.4


def _keep_alive(protocol: type[HotProtocol], seconds: float) -> type[HotProtocol]:
    """``protocol`` with uvicorn's keep-alive timeout set to ``seconds`` (its config's
    ``timeout_keep_alive``, read by the protocol as each connection opens)."""

    class ShortKeepAlive(protocol):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.timeout_keep_alive = seconds

    return ShortKeepAlive


@contextmanager
def _short_keep_alive_twins() -> Iterator[Twins]:
    with ExitStack() as stack:
        ports = []
        for hot in (True, False):
            fleet = Fleet.over(MemoryIndex())
            fleet.add("r1")
            deps = ApiDeps(SETTINGS, fleet.index, fleet.registry, MemoryLoadStore(), False)
            app = create_app(deps)
            protocol = hot_protocol(10.0, hot_serving(app) if hot else None)
            server = BackgroundServer(app, http=_keep_alive(protocol, KEEP_ALIVE_S))
            ports.append(stack.enter_context(server).port)
        yield Twins(*ports)


def _seconds_until_closed(sock: socket.socket) -> float:
    started = time.monotonic()
    sock.settimeout(5)
    assert sock.recv(1) == b""
    return time.monotonic() - started


@pytest.mark.parametrize("sent", [request("GET", "/healthz"), request("GET", "/readyz")])
def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(sent: bytes) -> None:
    """Answered by the hot path or by the app, on either server: one timer per connection
    closes it ``timeout_keep_alive`` after the last answer, however many came before."""
    with _short_keep_alive_twins() as twins:
        for port in twins.ports:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                reader = _Reader(sock)
                started = time.monotonic()
                for _ in range(5):  # busier than the timeout for longer than it
                    time.sleep(KEEP_ALIVE_S / 2)
                    sock.sendall(sent)
                    assert reader.answer().status_line.endswith(b"200 OK")
                    answered = time.monotonic()
                assert answered - started > 2 * KEEP_ALIVE_S
                # Idle from the last answer read (however late this thread ran) to the close.
                _seconds_until_closed(sock)
                idle_s = time.monotonic() - answered
                assert KEEP_ALIVE_S * 0.9 < idle_s < KEEP_ALIVE_S + 1.5


def test_a_slow_answer_pipelined_behind_a_hot_one_outlives_the_keep_alive_timeout() -> None:
    """The hot answer goes out while the next request is still unread in the same bytes:
    that request's time is no idle time, however long its answer takes."""

    async def slow(_body: bytes, _headers: Headers) -> bytes:
        await asyncio.sleep(2.5 * KEEP_ALIVE_S)
        return b'{"slow":true}'

    fleet = Fleet.over(MemoryIndex())
    app = create_app(ApiDeps(SETTINGS, fleet.index, fleet.registry, MemoryLoadStore(), False))
    serving = hot_serving(app)
    assert serving is not None
    key = (b"POST", b"/score")
    routes = serving.routes | {key: dataclasses.replace(serving.routes[key], answer=slow)}
    protocol = hot_protocol(10.0, dataclasses.replace(serving, routes=routes))
    with BackgroundServer(app, http=_keep_alive(protocol, KEEP_ALIVE_S)) as server:
        sent = exchange(server.port, request("GET", "/healthz") + request("POST", "/score", VALID),
                        num_answers=2)  # fmt: skip
    assert [a.body for a in sent.answers] == [b'{"status":"ok"}', b'{"slow":true}']


def test_a_body_cut_anywhere_is_read_whole(twins: Twins) -> None:
    sent = request("POST", "/score", VALID)
    start = sent.index(b"[")
    for cut in (start, start + 1, start + 6, len(sent) - 2, len(sent) - 1):
        answer = same(twins, sent[:cut], sent[cut:], pause_s=0.02).answers[0]
        assert answer.status_line == b"HTTP/1.1 200 OK"
    pieces = [sent[i : i + 97] for i in range(0, len(sent), 97)]
    assert same(twins, *pieces, pause_s=0.002).answers[0].status_line == b"HTTP/1.1 200 OK"


@pytest.mark.parametrize(
    "array",
    [b"[01, 2]", b"[4294967296]", b"[1.0]", b"[1e3]", b"[1,]", b"[1 2]", b'["1"]', b"[1,,2]"],
)
def test_token_arrays_the_packed_read_refuses_are_answered_alike(
    twins: Twins, array: bytes
) -> None:
    body = b'{"model": "' + MODEL.encode() + b'", "token_ids": ' + array + b"}"
    assert same(twins, request("POST", "/score", body)).answers[0].status_line[9:12] == b"422"


def test_huge_token_arrays_are_answered_alike() -> None:
    big = dataclasses.replace(SETTINGS, max_body_bytes=16 << 20)
    with twins_over(big) as twins:
        ids = tokens(1_000, 8) + list(range(2**32 - 200_000, 2**32))
        spaced = score_body(token_ids=ids).replace(b",", b", ")
        for body in (score_body(token_ids=ids), spaced):
            answer = same(twins, request("POST", "/score", body)).answers[0]
            assert answer.status_line == b"HTTP/1.1 200 OK"
        too_many = score_body(token_ids=[7] * (MAX_TOKEN_IDS + 1))
        assert same(twins, request("POST", "/score", too_many)).answers[0].status_line[9:12] == (
            b"422"
        )


H2C = {"connection": "Upgrade, HTTP2-Settings", "upgrade": "h2c", "http2_settings": "AAMAAABkAAQ"}


@pytest.mark.parametrize(
    "sent",
    [
        request("POST", "/score", VALID, **H2C),
        request("POST", "/score", VALID, connection="upgrade", upgrade="websocket"),
        request("POST", "/score", VALID, connection="keep-alive, Upgrade", upgrade="h2c"),
        request("GET", "/healthz", connection="Upgrade", upgrade="websocket"),
    ],
    ids=["h2c", "websocket", "keep-alive", "healthz"],
)
def test_a_request_asking_to_upgrade_is_answered_as_a_plain_one(twins: Twins, sent: bytes) -> None:
    """The ask ignored, the body read: both servers answer 200 and keep the connection, and
    a request pipelined behind is answered too."""
    exchanged = same(twins, sent + request("GET", "/healthz"), num_answers=2)
    assert [a.status_line for a in exchanged.answers] == [b"HTTP/1.1 200 OK"] * 2
    assert not exchanged.closed


def test_a_request_asking_to_upgrade_is_answered_when_its_head_comes_in_pieces(
    twins: Twins,
) -> None:
    sent = request("POST", "/score", VALID, **H2C)
    cut = sent.index(b"\r\n\r\n")
    for parts in (
        (sent[:30], sent[30:]),
        (sent[: cut + 4], sent[cut + 4 :]),
        (sent[: cut + 9], sent[cut + 9 :]),
    ):
        answer = same(twins, *parts).answers[0]
        assert answer.status_line == b"HTTP/1.1 200 OK"


_UPGRADING = {
    "get": request("GET", "/healthz"),
    "get-h2c": request("GET", "/healthz", b"", **H2C),
    "score": request("POST", "/score", VALID),
    "score-h2c": request("POST", "/score", VALID, **H2C),
}
_ONE_CONNECTION = [
    ("get", "get-h2c"),
    ("get-h2c", "get"),
    ("get-h2c", "get-h2c"),
    ("score", "get-h2c"),
    ("score", "score-h2c"),
    ("score-h2c", "score-h2c"),
    ("get-h2c", "score-h2c", "get"),
]


@pytest.mark.parametrize("names", _ONE_CONNECTION, ids=["+".join(n) for n in _ONE_CONNECTION])
@pytest.mark.parametrize("pipelined", [False, True], ids=["apart", "pipelined"])
def test_requests_asking_to_upgrade_on_one_connection_are_answered_as_plain_ones(
    twins: Twins, names: tuple[str, ...], pipelined: bool
) -> None:
    """Whatever came before on the connection (a hot answer, one to a request that asked
    to upgrade), the ask is ignored: 200s, as the plain server answers, the connection kept."""
    sent = [_UPGRADING[name] for name in names]
    parts = [b"".join(sent)] if pipelined else sent
    exchanged = same(twins, *parts, num_answers=len(sent))
    assert [a.status_line for a in exchanged.answers] == [b"HTTP/1.1 200 OK"] * len(sent)
    assert not exchanged.closed


def _drained_after_the_answer(port: int, head: bytes, first: bytes, rest: bytes) -> bytes:
    """Send ``head`` and ``first``, read the answer, then send ``rest`` (the server must
    still read it: no reset) and read until the server's end of the stream."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head + first)
        answer = sock.recv(65536)
        sock.sendall(rest)
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize("length", ["declared", "chunked"])
def test_the_rest_of_a_body_too_large_is_read_after_the_413(twins: Twins, length: str) -> None:
    """A client may send its whole body before it reads: after the 413 the server reads
    on (and drops) what comes, then ends the connection without a reset."""
    body = b"1" * (8 << 20)
    if length == "declared":
        head = request("POST", "/score").replace(
            b"content-length: 0", b"content-length: %d" % len(body)
        )
        first, rest = b"", body
    else:
        head = request("POST", "/score").replace(
            b"content-length: 0", b"transfer-encoding: chunked"
        )
        first, rest = (
            b"%x\r\n%s\r\n" % (len(body), body),
            b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body),
        )
    for port in twins.ports:
        answer = _drained_after_the_answer(port, head, first, rest)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert answer.endswith(b'(api.max_body_bytes)"}'), answer[-200:]


def test_the_rest_of_a_body_that_came_too_late_is_read_after_the_408(twins: Twins) -> None:
    """The hot path's own 408 (the body not whole within ``body_timeout_s``) lingers too."""
    body = score_body(token_ids=list(range(500)))
    head = request("POST", "/score").replace(
        b"content-length: 0", b"content-length: %d" % len(body)
    )
    for port in twins.ports:
        answer = _drained_after_the_answer(port, head, body[:10], body[10:] * 1000)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_a_connect_is_answered_as_uvicorn_answers_it(twins: Twins) -> None:
    """CONNECT, which the parser always takes as an upgrade, is not parsed again: its
    authority-form target is no URL uvicorn parses (400), on either server."""
    sent = b"CONNECT kvindex.test:443 HTTP/1.1\r\nhost: kvindex.test:443\r\n\r\n"
    answer = same(twins, sent).answers[0]
    assert answer.status_line == b"HTTP/1.1 400 Bad Request", answer
    # After a hot answer on the connection too (the cycle in hand is then a hot one).
    answers = same(twins, request("POST", "/score", VALID), sent, num_answers=2).answers
    assert [a.status_line.split()[1] for a in answers] == [b"200", b"400"]
