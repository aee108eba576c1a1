"""DeferredApp: the lifespan runs the read path; FastAPI's app is built on the first request
that reaches it, once, and answers as ``create_app``'s does."""

from __future__ import annotations

import asyncio
import threading

import pytest
from starlette.testclient import TestClient
from starlette.types import ASGIApp

from kvindex.api.config.settings import ApiSettings
from kvindex.api.http.app import create_app
from kvindex.api.http.server import served_app
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.runtime import ApiDeps
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex

SETTINGS = ApiSettings(scrape_interval_s=0.0, health_check_interval_s=0.0)


def _deps() -> ApiDeps:
    registry = Registry((ReplicaSpec("r1", "m"),))
    return ApiDeps(SETTINGS, MemoryIndex(), registry, MemoryLoadStore(), blocking_store=False)


def test_the_lifespan_starts_and_stops_the_read_path() -> None:
    app, _ = served_app(_deps())
    with TestClient(app):
        assert not app.core.read_path.http.is_closed
    assert app.core.read_path.http.is_closed


def test_the_app_is_built_once_on_first_use_and_answers_as_create_apps() -> None:
    app, _ = served_app(_deps())
    builds: list[ASGIApp] = []
    build = app.build

    def counted() -> ASGIApp:
        builds.append(build())
        return builds[-1]

    app.build = counted  # type: ignore[method-assign]
    with TestClient(app) as client, TestClient(create_app(_deps())) as reference:
        assert builds == []  # the lifespan needs no app
        assert client.get("/config").json() == reference.get("/config").json()
        assert client.get("/replicas").json() == reference.get("/replicas").json()
        assert (
            client.get("/readyz").json() == reference.get("/readyz").json() == {"status": "ready"}
        )
        assert client.get("/nowhere").status_code == 404
    assert len(builds) == 1


def test_the_hot_routes_need_no_app() -> None:
    app, hot = served_app(_deps())
    assert {(m.decode(), p.decode()) for m, p in hot.routes} == {
        ("GET", "/healthz"),
        ("GET", "/readyz"),
        ("POST", "/score"),
    }
    assert not app.built
    with TestClient(app) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
    assert app.built


def test_the_first_request_imports_fastapi_off_the_loop_and_concurrent_ones_build_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvindex.api.http.deferred_app as deferred  # noqa: PLC0415

    imported_on: list[bool] = []

    def recorded() -> None:
        imported_on.append(threading.current_thread() is threading.main_thread())

    monkeypatch.setattr(deferred, "_import_app", recorded)
    app, _ = served_app(_deps())
    builds: list[ASGIApp] = []
    build = app.build

    def counted() -> ASGIApp:
        builds.append(build())
        return builds[-1]

    app.build = counted  # type: ignore[method-assign]

    async def first_requests() -> None:
        await asyncio.gather(*(app._first_build() for _ in range(3)))

    asyncio.run(first_requests())
    assert imported_on == [False] and len(builds) == 1 and app.built
