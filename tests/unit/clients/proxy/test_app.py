"""The proxy app: forwarded routes answered before Starlette, the rest by it; /readyz, a
5xx's body and log line, and the access log on memory stores."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

import httpx
import msgspec
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvindex.api.config.settings import ApiSettings
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.runtime import ApiDeps
from kvindex.clients.proxy.app import _ProxyApp
from kvindex.clients.proxy.service import build_proxy_app
from kvindex.clients.proxy.settings import ProxySettings
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.fleet.replica_health import ReplicaHealth
from kvindex.indexer.index.memory import MemoryIndex


class Endpoint:
    """An ASGI endpoint that says who answered and counts what the framework added."""

    def __init__(self) -> None:
        self.scopes: list[Scope] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scopes.append(scope)
        await PlainTextResponse("hot")(scope, receive, send)


async def _other(_: Request) -> Response:
    return PlainTextResponse("router")


def _ask(app: _ProxyApp, method: str, path: str, root_path: str = "") -> tuple[int, str]:
    async def run() -> tuple[int, str]:
        transport = httpx.ASGITransport(app=app, root_path=root_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            response = await client.request(method, root_path + path)
            return response.status_code, response.text

    return asyncio.run(run())


def test_a_post_to_a_forwarded_path_skips_the_router_and_anything_else_takes_it() -> None:
    endpoint = Endpoint()
    routes = [
        Route("/v1/completions", endpoint, methods=["POST"]),
        Route("/v1/models", _other, methods=["GET"]),
    ]
    app = _ProxyApp({"/v1/completions": endpoint}, routes=routes)
    assert _ask(app, "POST", "/v1/completions") == (200, "hot")
    assert "endpoint" not in endpoint.scopes[-1]  # the router never saw it
    assert endpoint.scopes[-1]["app"] is app
    assert _ask(app, "GET", "/v1/models") == (200, "router")
    assert _ask(app, "GET", "/v1/completions")[0] == 405  # the router's answer, as before
    assert _ask(app, "POST", "/v1/completions", root_path="/under") == (200, "hot")
    assert "endpoint" in endpoint.scopes[-1]  # under a root path: through the router
    assert len(endpoint.scopes) == 2


# --- the whole app on memory stores: /readyz, a 5xx's body and log line, the access log ---

SETTINGS = ApiSettings(scrape_interval_s=0.0, health_check_interval_s=0.0, access_log=True)


def _proxy_on(*replicas: ReplicaSpec) -> tuple[Starlette, Registry]:
    registry = Registry(replicas)
    deps = ApiDeps(SETTINGS, MemoryIndex(), registry, MemoryLoadStore(), blocking_store=False)
    return build_proxy_app(deps, ProxySettings(max_attempts=2)), registry


def _send(app: Starlette, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(run())


def _dead_url() -> str:
    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def _open_breaker(health: ReplicaHealth) -> ReplicaHealth:
    return msgspec.structs.replace(health, breaker_open_until=time.time() + 60)


def test_readyz_is_503_with_no_routable_replica_and_says_why() -> None:
    app, _ = _proxy_on(ReplicaSpec("r1", "m"))  # registered, but no url to forward to
    answer = _send(app, "GET", "/readyz")
    assert answer.status_code == 503 and "no replica with a url" in answer.json()["detail"]
    app, registry = _proxy_on(ReplicaSpec("r1", "m", url=_dead_url()), ReplicaSpec("r2", "m"))
    assert _send(app, "GET", "/readyz").status_code == 200
    registry.update_health({"r1": _open_breaker})
    answer = _send(app, "GET", "/readyz")  # r2 has no url: it does not count
    assert answer.json()["detail"] == "every replica is out of routing: r1 (breaker)"
    app, registry = _proxy_on(*(ReplicaSpec(r, "m", url=_dead_url()) for r in ("r1", "r2")))
    registry.update_health({"r1": _open_breaker})
    assert _send(app, "GET", "/readyz").status_code == 200  # r2 still takes requests
    registry.update_health({"r2": _open_breaker})
    answer = _send(app, "GET", "/readyz")
    assert answer.status_code == 503
    assert answer.json()["detail"] == "every replica is out of routing: r1 (breaker), r2 (breaker)"


def test_a_502_body_has_its_request_id_and_the_log_the_replicas_and_reasons(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app, _ = _proxy_on(*(ReplicaSpec(r, "m", url=_dead_url()) for r in ("r1", "r2")))
    body = {"model": "m", "prompt": "a b c", "max_tokens": 1}
    headers = {"x-request-id": "req-7", "authorization": "Bearer client-secret"}
    with caplog.at_level(logging.INFO):
        answer = _send(app, "POST", "/v1/completions", json=body, headers=headers)
    assert answer.status_code == 502 and answer.headers["x-request-id"] == "req-7"
    assert answer.json() == {
        "error": {
            "message": "no replica could answer the request",
            "type": "upstream_failed",
            "code": 502,
            "request_id": "req-7",
        }
    }
    (failure,) = [
        r for r in caplog.records if r.name == "kvindex.proxy" and "req-7: 502" in r.message
    ]
    assert "r1: connect" in failure.message and "r2: connect" in failure.message
    assert failure.status == 502  # type: ignore[attr-defined]
    (access,) = [r for r in caplog.records if r.name == "kvindex.access"]
    fields = vars(access)
    assert (fields["request_id"], fields["status"], fields["replica"]) == ("req-7", 502, "none")
    assert fields["route"] == "/v1/completions" and fields["retries"] is None
    assert fields["ttfb_ms"] is None and fields["duration_ms"] > 0
    assert "client-secret" not in caplog.text


def test_a_routed_request_that_failed_has_its_receipt_behind_the_token() -> None:
    replicas = tuple(ReplicaSpec(r, "m", url=_dead_url()) for r in ("r1", "r2"))
    deps = ApiDeps(SETTINGS, MemoryIndex(), Registry(replicas), MemoryLoadStore(), False)
    app = build_proxy_app(deps, ProxySettings(max_attempts=2, auth_token="t"))
    body = {"model": "m", "prompt": list(range(40)), "max_tokens": 3}

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        token = {"authorization": "Bearer t"}
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            sent = await client.post(
                "/v1/completions", json=body, headers={**token, "x-request-id": "dead-1"}
            )
            return [
                sent,
                await client.get("/decisions/dead-1", headers=token),
                await client.get("/decisions/dead-1"),
                await client.get("/decisions", headers=token),
            ]

    sent, found, anonymous, listed = asyncio.run(run())
    assert sent.status_code == 502 and anonymous.status_code == 401
    receipt = found.json()
    assert receipt["id"] == "dead-1" and receipt["status"] == 502
    assert receipt["num_tokens"] == 40 and receipt["max_tokens"] == 3
    assert receipt["answered_by"] is None and receipt["outcome"] is None
    assert {receipt["chosen"], *receipt["fallbacks"]} == {"r1", "r2"}
    assert [r["id"] for r in listed.json()] == ["dead-1"]
