"""The indexer's status port: routes, methods, bounds, the cached store probe, readiness,
and the settings that place it; a real HTTP server on a free loopback port, no services."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvindex.indexer.config.settings import IndexerSettings, load_settings
from kvindex.indexer.domain.errors import SettingsError
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.service import IndexerService
from kvindex.indexer.status_server import (
    Answer,
    StatusPortError,
    StatusServer,
    StoreProbe,
    liveness,
    readiness,
    status_routes,
)
from tests.support.clock import Clock

ROUTES: dict[str, Callable[[], Answer]] = {"/x": lambda: Answer(200, "text/plain", b"hello")}


@contextmanager
def serving(
    routes: dict[str, Callable[[], Answer]], *, max_connections: int = 32, timeout_s: float = 5.0
) -> Iterator[tuple[StatusServer, httpx.Client]]:
    """A started server on a free port and a client of it; the server is stopped after."""
    server = StatusServer(
        "127.0.0.1", 0, routes, max_connections=max_connections, timeout_s=timeout_s
    )
    server.start()
    try:
        with httpx.Client(base_url=server.url, trust_env=False, timeout=2) as http:
            yield server, http
    finally:
        server.stop()


# --- the server -----------------------------------------------------------------------


def test_a_route_answers_get_and_head_and_ignores_the_query() -> None:
    with serving(ROUTES) as (_, http):
        got = http.get("/x?debug=1")
        assert (got.status_code, got.headers["content-type"], got.content) == (
            200,
            "text/plain",
            b"hello",
        )
        head = http.head("/x")
        assert (head.status_code, head.content, head.headers["content-length"]) == (200, b"", "5")


def test_an_unknown_path_is_404_and_another_method_405() -> None:
    with serving(ROUTES) as (_, http):
        missing = http.get("/nope")
        assert missing.status_code == 404 and missing.json()["path"] == "/nope"
        for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
            refused = http.request(method, "/x")
            assert refused.status_code == 405, method
            assert refused.headers["allow"] == "GET, HEAD"
        assert http.post("/nope").status_code == 404


def test_a_failing_route_answers_500_and_the_server_goes_on() -> None:
    def broken() -> Answer:
        raise RuntimeError("boom")

    with serving({**ROUTES, "/broken": broken}) as (_, http):
        answer = http.get("/broken")
        assert answer.status_code == 500 and "boom" in answer.json()["detail"]
        assert http.get("/x").status_code == 200


@pytest.mark.latency_bound
def test_a_silent_client_holds_neither_the_loop_nor_another_answer() -> None:
    with serving(ROUTES, timeout_s=5.0) as (server, http):
        idle = socket.create_connection(server.address)  # connects, never sends a request
        try:
            started = time.monotonic()
            assert http.get("/x").status_code == 200
            assert time.monotonic() - started < 0.5
        finally:
            idle.close()


def test_connections_past_the_limit_are_closed_until_a_slot_frees() -> None:
    with serving(ROUTES, max_connections=2, timeout_s=0.5) as (server, http):
        idle = [socket.create_connection(server.address) for _ in range(2)]
        try:
            time.sleep(0.1)  # both accepted, each holding a slot
            with pytest.raises(httpx.TransportError):
                http.get("/x")
        finally:
            for sock in idle:
                sock.close()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                assert http.get("/x").status_code == 200
                return
            except httpx.TransportError:
                time.sleep(0.05)
        raise AssertionError("a freed slot was not reused")


def test_an_ipv6_address_is_served_and_bracketed() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    server = StatusServer("::1", 0, ROUTES)
    try:
        server.start()
    except StatusPortError:
        pytest.skip("no ::1 on this host")
    try:
        assert server.url == f"http://[::1]:{server.address[1]}"
        assert httpx.get(f"{server.url}/x", trust_env=False, timeout=2).content == b"hello"
    finally:
        server.stop()


def test_a_port_in_use_is_named() -> None:
    with serving(ROUTES) as (server, _):
        taken = StatusServer("127.0.0.1", server.address[1], ROUTES)
        with pytest.raises(StatusPortError, match=rf"status port 127\.0\.0\.1:{server.address[1]}"):
            taken.start()


# --- the store probe ------------------------------------------------------------------


def test_a_store_in_the_process_is_always_up() -> None:
    probe = StoreProbe(None, interval_s=0.5)
    probe.start()
    assert probe.check().ok
    probe.stop()


def test_the_probe_reports_the_last_answer_and_why_it_failed() -> None:
    failing = [False]

    def ping() -> bool:
        if failing[0]:
            raise ConnectionError("refused")
        return True

    clock = Clock()
    probe = StoreProbe(ping, interval_s=0.5, clock=clock)
    assert probe.check().reasons == ("store not probed yet",)
    assert probe.probe_once().ok and probe.check().ok
    failing[0] = True
    probe.probe_once()
    assert probe.check().reasons == ("store unreachable: ConnectionError: refused",)
    failing[0] = False
    probe.probe_once()
    clock.now += 3 * 0.5 + 1.5
    assert not probe.check().ok and "stale" in probe.check().reasons[0]


@pytest.mark.latency_bound
def test_a_hung_store_never_blocks_a_check() -> None:
    release = threading.Event()
    probe = StoreProbe(lambda: release.wait(10), interval_s=0.05)
    probe.start()
    try:
        time.sleep(0.1)  # the probe thread is inside ping now
        started = time.monotonic()
        assert not probe.check().ok
        assert time.monotonic() - started < 0.05
    finally:
        release.set()
        probe.stop()


# --- the indexer's status -------------------------------------------------------------


def test_readiness_names_each_reason_and_liveness_ignores_the_store() -> None:
    alive, store_up = [True], [True]

    def ping() -> None:
        if not store_up[0]:
            raise TimeoutError("timed out")

    probe = StoreProbe(ping, interval_s=0.05)  # a store that can fail, as Redis does
    routes = status_routes(
        CollectorRegistry(),
        lambda: liveness(lambda: alive[0]),
        lambda: readiness(lambda: alive[0], probe),
    )
    probe.start()
    try:
        with serving(routes) as (_, http):
            _until(lambda: http.get("/readyz").status_code == 200)
            store_up[0] = False
            _until(lambda: http.get("/readyz").status_code == 503)
            assert http.get("/readyz").json() == {
                "status": "unavailable",
                "reasons": ["store unreachable: TimeoutError: timed out"],
            }
            assert http.get("/healthz").json() == {"status": "ok"}
            alive[0] = False
            assert http.get("/healthz").status_code == 503
            assert http.get("/readyz").json()["reasons"] == [
                "subscriber loop not running",
                "store unreachable: TimeoutError: timed out",
            ]
    finally:
        probe.stop()


def _until(check: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_the_service_serves_its_status_while_its_loop_runs() -> None:
    settings = IndexerSettings(status_port=0, replicas=(ReplicaSpec("r1", "m"),))
    service = IndexerService.build(settings, with_status=True)
    assert service.status is not None
    service.start()
    base = service.status.server.url
    try:
        with httpx.Client(base_url=base, trust_env=False, timeout=2) as http:
            assert http.get("/healthz").status_code == 200
            assert http.get("/readyz").json() == {"status": "ready"}
            metrics = http.get("/metrics")
            assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
            assert "kvindex_indexer_store_up 1.0" in metrics.text
            assert 'component="indexer"' in metrics.text
            service.subscriber.stop()
            assert http.get("/healthz").json() == {
                "status": "unhealthy",
                "reasons": ["subscriber loop not running"],
            }
    finally:
        service.stop()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{base}/healthz", timeout=1)


def test_no_status_port_unless_asked_or_when_off() -> None:
    assert IndexerService.build(IndexerSettings(status_port=0)).status is None
    assert IndexerService.build(IndexerSettings(status_port=-1), with_status=True).status is None


# --- settings -------------------------------------------------------------------------


def test_the_status_settings_come_from_env() -> None:
    env = {"KVINDEX_STATUS_PORT": "0", "KVINDEX_STATUS_HOST": "::1", "KVINDEX_STATUS_PROBE_S": "2"}
    settings = load_settings(env=env)
    assert (settings.status_port, settings.status_host, settings.status_probe_s) == (0, "::1", 2.0)
    assert IndexerSettings().status_port == 8090


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVINDEX_STATUS_PORT": "-2"}, "status_port must be -1 (off), 0 (any) or a port, got -2"),
        ({"KVINDEX_STATUS_PORT": "65536"}, "status_port must be -1"),
        ({"KVINDEX_STATUS_PORT": "http"}, "status_port must be an integer, got 'http'"),
        ({"KVINDEX_STATUS_PROBE_S": "0"}, "status_probe_s must be > 0, got 0.0"),
        ({"KVINDEX_STATUS_TIMEOUT_S": "-1"}, "status_timeout_s must be > 0, got -1.0"),
    ],
)
def test_a_bad_status_setting_names_its_key(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_settings(env=env)
