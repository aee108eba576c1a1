"""kvindex.clients.http against httpx.MockTransport: bodies, headers, decoding, errors.

Every test runs twice, with :class:`KvIndexClient` and :class:`AsyncKvIndexClient`
(the ``mode`` fixture), through :func:`invoke`: the two clients must behave the same.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import pickle
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import pytest

from kvindex.api.schemas import (
    ErrorBody,
    FreshnessView,
    LoadView,
    ReplicaView,
    ScoreEntry,
    ScoreResponse,
    StreamView,
)
from kvindex.clients.http import (
    AsyncKvIndexClient,
    BadRequestError,
    KvIndexClient,
    KvIndexClientError,
    NotFoundError,
    UnauthorizedError,
    UnavailableError,
    UnreachableError,
)
from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.keys import block_keys
from tests.support.paths import ROOT

BASE = "http://kvindex.test:8000"
MODEL = "demo-model"
BLOCK = 16
TOKENS = [(7919 * i) % 150_000 for i in range(3 * BLOCK + 5)]

Handler = Callable[[httpx.Request], httpx.Response]

SCORE = ScoreResponse(
    model=MODEL,
    block_size=BLOCK,
    num_tokens=len(TOKENS),
    num_blocks=3,
    best="r1",
    policy="kv_aware",
    weights={"hit": 1.0},
    scores=[
        ScoreEntry(
            replica="r1",
            rank=0,
            matched_blocks=3,
            matched_tokens=48,
            tiers={"gpu": 3, "cpu": 0, "other": 0},
            load=LoadView(1.0, 0.0, 0.5, 0.2, "push"),
            freshness=FreshnessView("live", 0.01, 0.5),
            terms={"hit": 1.0},
            score=1.0,
        )
    ],
    num_candidates=1,
    num_matched=1,
)
REPLICA = ReplicaView(
    id="r1",
    model=MODEL,
    events="tcp://127.0.0.1:5557",
    replay=None,
    url=None,
    dp_size=1,
    state="live",
    streams=[
        StreamView(
            rank=0,
            freshness=FreshnessView("live", None, 1.0),
            connected=True,
            last_seq=7,
            blocks={"gpu": 3, "cpu": 0, "other": 0},
            counters={"num_batches": 8},
        )
    ],
    load=None,
)


def answer(value: Any, status: int = 200) -> Handler:
    """A handler answering every request with ``value`` as JSON."""
    content = msgspec.json.encode(value)
    headers = {"content-type": "application/json"}
    return lambda _: httpx.Response(status, content=content, headers=headers)


def fail(exc: Exception) -> Handler:
    def handle(_: httpx.Request) -> httpx.Response:
        raise exc

    return handle


@dataclass
class Fake:
    """The server side of a MockTransport: records each request, answers with ``respond``."""

    respond: Handler
    requests: list[httpx.Request] = field(default_factory=list)

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.respond(request)

    @property
    def last(self) -> httpx.Request:
        return self.requests[-1]

    @property
    def body(self) -> Any:
        return json.loads(self.last.content)


@pytest.fixture(params=["sync", "async"])
def mode(request: pytest.FixtureRequest) -> str:
    mode: str = request.param
    return mode


def invoke(mode: str, fake: Fake, method: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``method`` on a client of the given mode whose transport is ``fake``.

    ``token`` and ``timeout_s`` in ``kwargs`` go to the client's constructor.
    """
    options = {k: kwargs.pop(k) for k in ("token", "timeout_s") if k in kwargs}
    transport = httpx.MockTransport(fake.handle)
    if mode == "sync":
        with (
            httpx.Client(transport=transport) as http,
            KvIndexClient(BASE, http=http, **options) as client,
        ):
            return getattr(client, method)(*args, **kwargs)

    async def main() -> Any:
        async with (
            httpx.AsyncClient(transport=transport) as http,
            AsyncKvIndexClient(BASE, http=http, **options) as client,
        ):
            return await getattr(client, method)(*args, **kwargs)

    return asyncio.run(main())


# --- request bodies -------------------------------------------------------------------------


def test_score_sends_only_given_fields_and_decodes(mode: str) -> None:
    fake = Fake(answer(SCORE))
    result = invoke(mode, fake, "score", MODEL, token_ids=TOKENS)
    assert fake.last.method == "POST"
    assert str(fake.last.url) == f"{BASE}/score"
    assert fake.last.headers["content-type"] == "application/json"
    assert fake.body == {"model": MODEL, "token_ids": TOKENS}
    assert result == SCORE
    assert isinstance(result, ScoreResponse)
    assert isinstance(result.scores[0], ScoreEntry)
    assert isinstance(result.scores[0].load, LoadView)


def test_score_sends_every_field(mode: str) -> None:
    fake = Fake(answer(SCORE))
    messages = [{"role": "user", "content": "hi"}]
    invoke(
        mode,
        fake,
        "score",
        MODEL,
        prompt="hi",
        messages=messages,
        block_keys=(1, 2**64 - 1),
        lora_name="sql",
        cache_salt="tenant",
        session="s1",
        candidates=("r1", "r2"),
        policy="least_load",
        weights={"waiting": 0.5},
        top_k=5,
    )
    assert fake.body == {
        "model": MODEL,
        "prompt": "hi",
        "messages": messages,
        "block_keys": [1, 2**64 - 1],
        "lora_name": "sql",
        "cache_salt": "tenant",
        "session": "s1",
        "candidates": ["r1", "r2"],
        "policy": "least_load",
        "weights": {"waiting": 0.5},
        "top_k": 5,
    }


def test_score_tokens_sends_the_indexers_block_keys(mode: str) -> None:
    fake = Fake(answer(SCORE))
    result = invoke(
        mode, fake, "score_tokens", MODEL, TOKENS, block_size=BLOCK, session="s1", workload="rag"
    )
    assert fake.body == {
        "model": MODEL,
        "block_keys": block_keys(MODEL, TOKENS, BLOCK),
        "block_size": BLOCK,
        "session": "s1",
        "workload": "rag",
    }
    assert len(fake.body["block_keys"]) == 3
    assert result == SCORE


def test_score_tokens_keys_carry_lora_and_salt(mode: str) -> None:
    fake = Fake(answer(SCORE))
    invoke(
        mode,
        fake,
        "score_tokens",
        MODEL,
        tuple(TOKENS),
        block_size=BLOCK,
        lora_name="sql",
        cache_salt="tenant",
    )
    expected = block_keys(MODEL, TOKENS, BLOCK, lora_name="sql", cache_salt="tenant")
    assert expected != block_keys(MODEL, TOKENS, BLOCK)
    assert fake.body == {"model": MODEL, "block_keys": expected, "block_size": BLOCK}


def test_score_tokens_without_keys_sends_tokens(mode: str) -> None:
    fake = Fake(answer(SCORE))
    invoke(
        mode,
        fake,
        "score_tokens",
        MODEL,
        TOKENS,
        block_size=BLOCK,
        compute_keys=False,
        lora_name="sql",
    )
    assert fake.body == {"model": MODEL, "token_ids": TOKENS, "lora_name": "sql"}


def test_score_tokens_checks_the_servers_block_size(mode: str) -> None:
    fake = Fake(answer(SCORE))
    with pytest.raises(BadRequestError, match="block_size=32") as caught:
        invoke(mode, fake, "score_tokens", MODEL, TOKENS, block_size=32)
    assert (caught.value.kind, caught.value.status) == ("block_size_mismatch", None)


def test_score_tokens_rejects_bad_tokens_locally(mode: str) -> None:
    fake = Fake(answer(SCORE))
    with pytest.raises(BadRequestError, match="token_ids") as caught:
        invoke(mode, fake, "score_tokens", MODEL, [1, -1] * BLOCK, block_size=BLOCK)
    assert caught.value.kind == "invalid_request"
    assert fake.requests == []


def test_report_load_body(mode: str) -> None:
    fake = Fake(answer({"status": "ok"}))
    assert invoke(mode, fake, "report_load", "r1", 2, 1.5) is None
    assert str(fake.last.url) == f"{BASE}/load"
    assert fake.body == {"replica": "r1", "running": 2, "waiting": 1.5, "kv_usage": 0.0}
    invoke(mode, fake, "report_load", "r1", 0, 0, kv_usage=0.25, ts=1700000000.5)
    assert fake.body == {
        "replica": "r1",
        "running": 0,
        "waiting": 0,
        "kv_usage": 0.25,
        "ts": 1700000000.5,
    }


@pytest.mark.parametrize(("status", "created"), [(201, True), (200, False)])
def test_add_replica(mode: str, status: int, created: bool) -> None:
    fake = Fake(answer({"status": "x", "id": "r3"}, status))
    assert invoke(mode, fake, "add_replica", "r3", MODEL, url="http://10.0.0.3:8000") is created
    assert (fake.last.method, str(fake.last.url)) == ("POST", f"{BASE}/replicas")
    assert fake.body == {"id": "r3", "model": MODEL, "url": "http://10.0.0.3:8000", "dp_size": 1}


def test_remove_replica(mode: str) -> None:
    fake = Fake(answer({"status": "removed", "id": "r/1"}))
    assert invoke(mode, fake, "remove_replica", "r/1") is None
    assert fake.last.method == "DELETE"
    assert fake.last.url.raw_path == b"/replicas/r%2F1"
    assert fake.last.content == b""
    assert "content-type" not in fake.last.headers


# --- decoding ---------------------------------------------------------------------------


def test_replicas_decode_into_views(mode: str) -> None:
    fake = Fake(answer([REPLICA]))
    (view,) = invoke(mode, fake, "replicas")
    assert (fake.last.method, str(fake.last.url)) == ("GET", f"{BASE}/replicas")
    assert view == REPLICA
    assert isinstance(view, ReplicaView)
    assert isinstance(view.streams[0], StreamView)


@pytest.mark.parametrize("method", ["stats", "config"])
def test_info_routes_decode_into_dicts(mode: str, method: str) -> None:
    payload = {"replicas": 2, "blocks": {"gpu": 5}}
    fake = Fake(answer(payload))
    assert invoke(mode, fake, method) == payload
    assert str(fake.last.url) == f"{BASE}/{method}"


def test_unexpected_answer_shape_is_an_error(mode: str) -> None:
    fake = Fake(answer({"model": MODEL}))
    with pytest.raises(KvIndexClientError, match="invalid_response") as caught:
        invoke(mode, fake, "score", MODEL, token_ids=[1])
    assert caught.value.status == 200


# --- headers and timeout --------------------------------------------------------------------


def test_bearer_token_is_sent(mode: str) -> None:
    fake = Fake(answer([]))
    invoke(mode, fake, "replicas", token="s3cret")
    assert fake.last.headers["authorization"] == "Bearer s3cret"
    invoke(mode, fake, "replicas")
    assert "authorization" not in fake.last.headers


def test_timeout_applies_to_every_phase(mode: str) -> None:
    fake = Fake(answer([]))
    invoke(mode, fake, "replicas", timeout_s=1.5)
    assert fake.last.extensions["timeout"] == dict.fromkeys(
        ("connect", "read", "write", "pool"), 1.5
    )


# --- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind", "error_type"),
    [
        (422, "invalid_request", BadRequestError),
        (404, "unknown_model", NotFoundError),
        (401, "unauthorized", UnauthorizedError),
        (502, "tokenizer_failed", UnavailableError),
        (503, "store_unavailable", UnavailableError),
        (500, "internal", KvIndexClientError),
    ],
)
def test_error_status_maps_to_its_exception(
    mode: str, status: int, kind: str, error_type: type[KvIndexClientError]
) -> None:
    fake = Fake(answer(ErrorBody(kind, "the detail"), status))
    with pytest.raises(error_type) as caught:
        invoke(mode, fake, "score", MODEL, token_ids=[1])
    error = caught.value
    assert type(error) is error_type
    assert (error.status, error.kind, error.detail) == (status, kind, "the detail")
    assert str(error) == f"{kind} (HTTP {status}): the detail"
    assert isinstance(error, KvIndexError)


def test_error_without_kvindex_body(mode: str) -> None:
    fake = Fake(answer({"detail": "Not Found"}, 404))
    with pytest.raises(NotFoundError) as caught:
        invoke(mode, fake, "stats")
    assert (caught.value.kind, caught.value.detail) == ("http_404", "Not Found")

    proxy = Fake(lambda _: httpx.Response(502, text="<html>Bad Gateway</html>"))
    with pytest.raises(UnavailableError) as unavailable:
        invoke(mode, proxy, "stats")
    assert (unavailable.value.kind, unavailable.value.detail) == (
        "http_502",
        "<html>Bad Gateway</html>",
    )


@pytest.mark.parametrize(
    "exc", [httpx.ConnectError("connection refused"), httpx.ReadTimeout("timed out")]
)
def test_transport_failure_is_unreachable(mode: str, exc: Exception) -> None:
    fake = Fake(fail(exc))
    with pytest.raises(UnreachableError) as caught:
        invoke(mode, fake, "score", MODEL, token_ids=[1])
    error = caught.value
    assert (error.status, error.kind) == (None, "unreachable")
    assert type(exc).__name__ in error.detail
    assert f"POST {BASE}/score" in error.detail


def test_errors_pickle() -> None:
    error = NotFoundError("unknown_model", "no such model", 404)
    again = pickle.loads(pickle.dumps(error))
    assert (type(again), again.kind, again.detail, again.status) == (
        NotFoundError,
        "unknown_model",
        "no such model",
        404,
    )


# --- probes -------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["healthy", "ready"])
@pytest.mark.parametrize(
    ("handler", "expected"),
    [
        (answer({"status": "ok"}), True),
        (answer({"status": "unavailable", "detail": "redis down"}, 503), False),
        (answer(ErrorBody("unauthorized", "no token"), 401), False),
        (fail(httpx.ConnectError("connection refused")), False),
    ],
)
def test_probes_never_raise(mode: str, method: str, handler: Handler, expected: bool) -> None:
    fake = Fake(handler)
    assert invoke(mode, fake, method) is expected
    path = {"healthy": "/healthz", "ready": "/readyz"}[method]
    assert (fake.last.method, fake.last.url.path) == ("GET", path)


# --- lifecycle -----------------------------------------------------------------------------


def test_injected_clients_stay_open() -> None:
    transport = httpx.MockTransport(Fake(answer({})).handle)
    with httpx.Client(transport=transport) as http:
        KvIndexClient(BASE, http=http).close()
        assert not http.is_closed

    async def main() -> None:
        async with httpx.AsyncClient(transport=transport) as http:
            await AsyncKvIndexClient(BASE, http=http).close()
            assert not http.is_closed

    asyncio.run(main())


def test_own_clients_are_closed() -> None:
    with KvIndexClient(BASE) as client:
        http = client._http
    assert http.is_closed

    async def main() -> None:
        async with AsyncKvIndexClient(BASE) as client:
            async_http = client._http
        assert async_http.is_closed

    asyncio.run(main())


def test_sync_and_async_clients_have_the_same_methods() -> None:
    def public(cls: type) -> dict[str, Any]:
        return {n: f for n, f in vars(cls).items() if not n.startswith("_") and callable(f)}

    sync, async_ = public(KvIndexClient), public(AsyncKvIndexClient)
    assert set(async_) == set(sync) | {"aclose"}
    for name, method in sync.items():
        assert inspect.signature(async_[name]) == inspect.signature(method), name
        assert inspect.iscoroutinefunction(async_[name]), name


def test_import_needs_no_fastapi() -> None:
    code = (
        "import sys, kvindex.clients.http; assert 'fastapi' not in sys.modules, 'fastapi imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=30)


@pytest.mark.parametrize("method", ["score", "score_tokens"])
def test_a_dry_run_is_sent_only_when_asked(mode: str, method: str) -> None:
    fake = Fake(answer(SCORE))
    kwargs: dict[str, Any] = {"block_size": BLOCK} if method == "score_tokens" else {}
    args = (MODEL, TOKENS) if method == "score_tokens" else (MODEL,)
    if method == "score":
        kwargs["token_ids"] = TOKENS
    invoke(mode, fake, method, *args, dry_run=True, **kwargs)
    assert fake.body["dry_run"] is True
    invoke(mode, fake, method, *args, **kwargs)
    assert "dry_run" not in fake.body  # a server older than the flag refuses unknown fields


@pytest.mark.parametrize("method", ["score", "score_tokens"])
def test_top_k_is_sent_only_when_asked(mode: str, method: str) -> None:
    """0 (every candidate) is sent as 0; unset is left out (the server's default)."""
    fake = Fake(answer(SCORE))
    kwargs: dict[str, Any] = {"block_size": BLOCK} if method == "score_tokens" else {}
    args = (MODEL, TOKENS) if method == "score_tokens" else (MODEL,)
    if method == "score":
        kwargs["token_ids"] = TOKENS
    for top_k in (0, 3):
        invoke(mode, fake, method, *args, top_k=top_k, **kwargs)
        assert fake.body["top_k"] == top_k
    invoke(mode, fake, method, *args, **kwargs)
    assert "top_k" not in fake.body
