"""The proxy app's front: forwarded routes answered before Starlette, the rest by it."""

from __future__ import annotations

import asyncio

import httpx
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvindex.clients.proxy.app import _ProxyApp


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
