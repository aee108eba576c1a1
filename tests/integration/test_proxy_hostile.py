"""``kvindex proxy`` under hostile input, black box: distinct huge bodies do not grow it for
good, a non-ASCII header value is forwarded, deep nesting is a 400, hop-by-hop headers stop
at the proxy and the client is appended to ``X-Forwarded-For`` / ``Forwarded``, the token is
asked on every spelling of a guarded route, and generated bodies and headers never get a
5xx or a reset. Real ``kvindex replica-sim``s behind a real proxy (and, where what a replica
receives must be seen, a loopback server that echoes the request's headers)."""

from __future__ import annotations

import http.client
import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.test_proxy_forwarding import MODEL, Proxy, _start
from tests.support.processes import http_ok, kvindex_child
from tests.support.redis_server import free_port

pytestmark = pytest.mark.timeout(120)
TOKEN = "client-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 2}


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict[str, Any]:
        """The proxy's own OpenAI-shaped error (AssertionError when not so shaped)."""
        error = json.loads(self.body)["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str)
        assert error["code"] == self.status
        return dict(error)


def send(
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    headers: list[tuple[str, bytes]] | None = None,
) -> Answer:
    """One request exactly as written (path and header bytes untouched)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.putrequest(method, path, skip_accept_encoding=True)
        for name, value in [("content-type", b"application/json"), *(headers or [])]:
            connection.putheader(name, value)
        connection.putheader("content-length", str(len(body)))
        connection.endheaders(body)
        answer = connection.getresponse()
        return Answer(answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read())
    finally:
        connection.close()


def post(
    port: int, path: str, body: object, headers: list[tuple[str, bytes]] | None = None
) -> Answer:
    return send(port, "POST", path, json.dumps(body).encode(), headers)


def _token(value: str = f"Bearer {TOKEN}") -> list[tuple[str, bytes]]:
    return [("authorization", value.encode())]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    """A proxy asking ``TOKEN`` in front of one sim."""
    workdir = tmp_path_factory.mktemp("guarded")
    (workdir / "token").write_text(TOKEN + "\n")
    proxy_args = ("--token-file", str(workdir / "token"))
    with ExitStack() as stack:
        _, proxy = _start(stack, workdir, {"r1": []}, proxy_args)
        yield proxy


# --- finding 1: memory ----------------------------------------------------------------

BODY_BYTES = 7_000_000
NUM_BODIES = 48
MAX_GROWTH_MB = 64
"""Its tokenizer cache (32 MiB, filled after about 37 of these bodies) and what one 7 MB
request leaves behind; an old proxy kept every body as a cache key (more than 7 MB each),
and a newer one left its heaps at their peak."""


def _vm_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def _big_chat(number: int) -> bytes:
    word = "w" * 31 + " "  # the sim's toy tokenizer: a token per word
    content = f"body {number} " + word * ((BODY_BYTES - 120) // len(word))
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]}).encode()


def test_distinct_large_bodies_do_not_grow_the_proxy(tmp_path: Path) -> None:
    with ExitStack() as stack:
        # The sim tokenizes each 7 MB body on its event loop, silent meanwhile: on a loaded
        # host that can outlast hang_silence_s and its one replica be taken for hung (a 502
        # once in CI). What is measured here is memory, not hang detection.
        config = tmp_path / "kvindex.toml"
        config.write_text("[proxy]\nhang_silence_s = 30.0\n")
        sims = {"r1": ["--capacity-blocks", "16384"]}
        _, proxy = _start(stack, tmp_path, sims, ("--config", str(config)))
        assert proxy.child.process is not None
        pid = proxy.child.process.pid
        for _ in range(8):  # warm: pools, arenas, the first tokenizations
            assert post(proxy.port, "/v1/chat/completions", CHAT).status == 200
        base = _vm_rss_kib(pid)
        growth_mb = 0.0
        for number in range(NUM_BODIES):
            answer = send(proxy.port, "POST", "/v1/chat/completions", _big_chat(number))
            assert answer.status == 200, answer.body[:300]
            growth_mb = max(growth_mb, (_vm_rss_kib(pid) - base) / 1024)
        print(f"RSS growth after {NUM_BODIES} distinct 7 MB bodies: {growth_mb:.1f} MB")
        assert growth_mb <= MAX_GROWTH_MB


# --- findings 6 and 8: headers, seen by an echoing replica ------------------------------


class _Echo(http.server.BaseHTTPRequestHandler):
    """Answers every request with the raw header lines it received, as JSON."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        lines = [(n, v.encode("latin-1").hex()) for n, v in self.headers.raw_items()]
        body = json.dumps({"headers": lines}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST  # noqa: N815 (the stdlib's name)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture(scope="module")
def echoed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A proxy whose one replica echoes the headers it gets: the proxy's port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    workdir = tmp_path_factory.mktemp("echoed")
    with ExitStack() as stack:
        thread.start()
        stack.callback(server.server_close)
        stack.callback(server.shutdown)
        port = free_port()
        spec = f"id=e1,model={MODEL},url=http://127.0.0.1:{server.server_port}"
        args = ["proxy", "--port", str(port), "--replica", spec]
        proxy = kvindex_child("proxy", args, workdir / "proxy.log", http_ok(port, "/readyz"))
        stack.callback(proxy.stop)
        proxy.start(40)
        yield port


def _received(answer: Answer) -> list[tuple[str, bytes]]:
    assert answer.status == 200, answer.body[:300]
    return [(n.lower(), bytes.fromhex(v)) for n, v in json.loads(answer.body)["headers"]]


def test_a_non_ascii_header_value_is_forwarded_as_sent(echoed: int) -> None:
    for value in ("José".encode(), "José".encode("latin-1")):
        got = _received(post(echoed, "/v1/chat/completions", CHAT, [("x-user", value)]))
        assert ("x-user", value) in got


@pytest.mark.parametrize("value", [b"a\x01b", b"a\x00b"], ids=["SOH", "NUL"])
def test_a_control_character_in_a_header_is_a_400_not_a_5xx(echoed: int, value: bytes) -> None:
    answer = post(echoed, "/v1/chat/completions", CHAT, [("x-bad", value)])
    assert answer.status == 400
    answer.error()  # OpenAI's shape, whether the proxy or its HTTP parser refused it


def test_hop_by_hop_headers_stop_at_the_proxy(echoed: int) -> None:
    sent = [
        ("connection", b"keep-alive, x-hop"),
        ("x-hop", b"secret"),
        ("proxy-connection", b"keep-alive"),
        ("x-kept", b"1"),
    ]
    got = dict(_received(post(echoed, "/v1/chat/completions", CHAT, sent)))
    assert "x-hop" not in got and "proxy-connection" not in got
    assert got["x-kept"] == b"1"


def test_the_client_is_appended_to_x_forwarded_for_and_forwarded(echoed: int) -> None:
    sent = [("x-forwarded-for", b"203.0.113.7"), ("forwarded", b"for=203.0.113.7")]
    got = dict(_received(post(echoed, "/v1/chat/completions", CHAT, sent)))
    assert got["x-forwarded-for"] == b"203.0.113.7, 127.0.0.1"
    assert got["forwarded"] == b"for=203.0.113.7, for=127.0.0.1;proto=http"
    alone = dict(_received(post(echoed, "/v1/chat/completions", CHAT)))
    assert alone["x-forwarded-for"] == b"127.0.0.1"


# --- finding 7: nesting ---------------------------------------------------------------


@pytest.mark.parametrize("depth", [65, 100_000])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
def test_deep_nesting_is_a_400(guarded: Proxy, path: str, depth: int) -> None:
    nested = b"[" * depth + b"]" * depth
    body = b'{"model": "' + MODEL.encode() + b'", "messages": ' + nested + b', "prompt": "a"}'
    answer = send(guarded.port, "POST", path, body, _token())
    assert answer.status == 400, answer.body[:300]
    assert "nests deeper" in answer.error()["message"]


# --- the usage the proxy asks of a stream ----------------------------------------------

ODD_STREAMS = [
    b'{"model": "M", "prompt": "a b", "stream": true, "stream_options": "yes"}',
    b'{"model": "M", "prompt": "a b", "stream": true, "stream_options": [1, 2]}',
    b'{"model": "M", "prompt": "a b", "stream": true, "stream_options": null}',
    b'{"model": "M", "prompt": "a b", "stream": true, "stream_options": {"include_usage": "x"}}',
    b'{"model": "M", "prompt": "a b", "stream": "true", "stream_options": {}}',
    b'{"model": "M", "prompt": "a b", "stream": 1}',
    b' \n\t{"model": "M", "prompt": "a b", "stream": true}',
    b'{"model": "M", "prompt": "a b", "stream": true, "stream": false}',
    b'{"model": "M", "messages": [{"role": "user", "content": "a"}], "stream": true,'
    b' "stream_options": {"include_usage": false, "continuous_usage_stats": true}}',
]


@pytest.mark.parametrize("body", ODD_STREAMS, ids=range(len(ODD_STREAMS)))
def test_odd_stream_asks_get_an_answer_never_a_5xx(guarded: Proxy, body: bytes) -> None:
    """The proxy splices ``stream_options`` into a stream's body to read its usage: a body
    that asks oddly is passed on or refused with a 4xx (the replica's or the proxy's)."""
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    answer = send(guarded.port, "POST", path, body.replace(b'"M"', f'"{MODEL}"'.encode()), _token())
    assert answer.status < 500, answer.body[:300]


def test_a_client_cannot_forge_the_tokenizer_mark(guarded: Proxy) -> None:
    """``x-kvindex-tokenizer`` on an answer is the proxy's: a client's own goes no further
    than the request, and a tokenized route's answer carries none."""
    body = {"model": MODEL, "prompt": "a b c", "max_tokens": 1}
    headers = [*_token(), ("x-kvindex-tokenizer", b"failed")]
    answer = post(guarded.port, "/v1/completions", body, headers)
    assert answer.status == 200 and "x-kvindex-tokenizer" not in answer.headers


# --- auth leftovers ---------------------------------------------------------------------

GUARDED_PATHS = [
    ("GET", "/metrics"), ("GET", "/metrics/"), ("GET", "//metrics"), ("GET", "/./metrics"),
    ("GET", "/x/../metrics"), ("GET", "/v1/models"), ("GET", "/v1/models/"),
    ("GET", "/v1//models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/chat/completions/"),
    ("POST", "/v1/./completions"), ("POST", "/v1/embeddings"), ("POST", "/tokenize"),
    ("POST", "/tokenize/"), ("GET", "/nope"), ("POST", "/v1/unknown"), ("GET", "/"),
    ("GET", "/replicas"), ("GET", "/replicas/"), ("GET", "/v1/../replicas"), ("GET", "/stats"),
    ("GET", "//stats"), ("POST", "/replicas"), ("DELETE", "/replicas/r1"),
]  # fmt: skip
WRONG_CREDENTIALS: list[list[tuple[str, bytes]]] = [
    [],
    _token("Bearer wrong"),
    _token(f"Basic {TOKEN}"),
    _token(TOKEN),
    _token(f"Bearer {TOKEN}x"),
    _token(f"Bearer\t{TOKEN}"),
    [*_token(), *_token()],
]


@pytest.mark.parametrize(("method", "path"), GUARDED_PATHS)
def test_every_spelling_of_a_guarded_route_asks_the_token(
    guarded: Proxy, method: str, path: str
) -> None:
    for credentials in WRONG_CREDENTIALS:
        answer = send(guarded.port, method, path, json.dumps(CHAT).encode(), credentials)
        assert answer.status == 401, (path, credentials, answer.status)
        assert answer.error()["type"] == "unauthorized"
        assert "x-kvindex-replica" not in answer.headers


def test_the_token_opens_them_and_the_probes_need_none(guarded: Proxy) -> None:
    for path in ("/health", "/healthz/", "//readyz"):
        assert send(guarded.port, "GET", path).status in (200, 307), path
    for value in (f"Bearer {TOKEN}", f"bearer {TOKEN}", f"Bearer  {TOKEN}", f"Bearer {TOKEN} "):
        # Whitespace around a value is not part of it (RFC 9110 §5.5): the same token.
        assert send(guarded.port, "GET", "/metrics", headers=_token(value)).status == 200, value


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/replicas"), ("DELETE", "/replicas/r1"), ("PUT", "/stats"),
     ("GET", "/replicas?x=%00%ff"), ("GET", "/stats/../../etc/passwd"), ("GET", "/replicas/r1")],
)  # fmt: skip
def test_the_proxys_read_routes_refuse_what_they_do_not_serve(
    guarded: Proxy, method: str, path: str
) -> None:
    """``/replicas`` and ``/stats`` are read-only here: anything else is a 4xx in OpenAI's
    shape, the proxy's own (no replica asked)."""
    answer = send(guarded.port, method, path, b'{"id": "r9"}', _token())
    if answer.status == 200:  # a query string the route ignores
        assert path.startswith("/replicas?"), path
        return
    assert 400 <= answer.status < 500, (path, answer.status, answer.body[:200])
    answer.error()
    assert "x-kvindex-replica" not in answer.headers


def test_tokenize_passes_through_when_listed(tmp_path: Path) -> None:
    (tmp_path / "token").write_text(TOKEN + "\n")
    config = tmp_path / "kvindex.toml"
    config.write_text('[proxy]\nextra_routes = ["/tokenize"]\n')
    proxy_args = ("--token-file", str(tmp_path / "token"), "--config", str(config))
    with ExitStack() as stack:
        _, proxy = _start(stack, tmp_path, {"r1": []}, proxy_args)
        body = {"model": MODEL, "prompt": "a b c"}
        assert post(proxy.port, "/tokenize", body).status == 401
        answer = post(proxy.port, "/tokenize", body, _token())
        assert answer.status == 200 and answer.headers.get("x-kvindex-replica") == "r1"
        assert json.loads(answer.body)["count"] == 3


# --- generated hostile input ------------------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from([MODEL, "other"]) | _JSON,
        "messages": st.lists(
            st.fixed_dictionaries({}, optional={"role": _JSON, "content": _JSON}), max_size=3
        )
        | _JSON,
        "prompt": st.text() | st.lists(st.integers(), max_size=5) | _JSON,
        "max_tokens": st.integers(-5, 5) | _JSON,
        "stream": _JSON,
    },
)
_BODIES = (
    _FIELDS.map(lambda v: json.dumps(v).encode())
    | _JSON.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=64)
)
_HEADER_VALUES = st.binary(max_size=24).map(lambda b: bytes(c for c in b if c not in b"\r\n"))
_HEADERS = st.lists(
    st.tuples(st.sampled_from(["x-user", "connection", "x-forwarded-for", "forwarded",
                               "x-request-id", "x-kvindex-session", "te", "content-type"]),
              _HEADER_VALUES),
    max_size=3,
)  # fmt: skip


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    route=st.sampled_from(
        [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models")]
    ),
    body=_BODIES,
    headers=_HEADERS,
)
def test_generated_bodies_and_headers_get_no_5xx(
    guarded: Proxy, route: tuple[str, str], body: bytes, headers: list[tuple[str, bytes]]
) -> None:
    method, path = route
    answer = send(guarded.port, method, path, body, [*headers, *_token()])
    assert answer.status < 500, (answer.status, answer.body[:300])
    if answer.status >= 400 and "x-kvindex-replica" not in answer.headers:
        answer.error()  # the proxy's own answer (the parser's 400 too): OpenAI's shape
