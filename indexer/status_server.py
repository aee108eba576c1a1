"""The indexer's status port, plain HTTP: ``/metrics`` (Prometheus text), ``/healthz`` (200
while the subscriber's loop runs; never touches the store), ``/readyz`` (200 when it runs
and the store answered its cached probe, else 503 with ``reasons``). A daemon thread per
connection with a socket timeout, at most ``max_connections`` at once."""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, NamedTuple

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.fleet.registry import RegistryView
from kvindex.indexer.index.protocol import BlockIndex
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.metrics import IndexerProcessCollector, IngestCollector
from kvindex.indexer.redis.connection import connect_bounded, ping

if TYPE_CHECKING:
    from kvindex.indexer.fleet.discovery import DiscoveryCounts

log = logging.getLogger("kvindex.status_server")

_JSON = "application/json"


class StatusPortError(KvIndexError):
    """The status port cannot be opened (in use, or an address not of this host)."""


class Check(NamedTuple):
    ok: bool
    reasons: tuple[str, ...] = ()


class Answer(NamedTuple):
    status: int
    content_type: str
    body: bytes


# --- the store probe --------------------------------------------------------------------


class StoreProbe:
    """Whether the index store answers, asked every ``interval_s`` by a background thread;
    :meth:`check` never waits on the store. No answer yet, or a stale one: down.
    ``ping=None``: a store in the process, always up. Thread-safe."""

    def __init__(
        self,
        ping: Callable[[], object] | None,
        *,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ping = ping
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last = Check(False, ("store not probed yet",))
        self._last_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._ping is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kvindex-store-probe", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._interval_s + 5.0)

    def check(self) -> Check:
        if self._ping is None:
            return Check(True)
        with self._lock:
            last, last_at = self._last, self._last_at
        if last_at is not None and self._clock() - last_at > 3 * self._interval_s + 1.0:
            return Check(False, (f"store probe stale for {self._clock() - last_at:.1f}s",))
        return last

    def is_up(self) -> bool:
        return self.check().ok

    def probe_once(self) -> Check:
        assert self._ping is not None
        try:
            self._ping()
            verdict = Check(True)
        except Exception as exc:  # any failure to answer is "down", whatever the client raised
            verdict = Check(False, (f"store unreachable: {type(exc).__name__}: {exc}",))
        with self._lock:
            changed = verdict.ok != self._last.ok and self._last_at is not None
            self._last, self._last_at = verdict, self._clock()
        if changed:
            log.warning("index store %s", "reachable again" if verdict.ok else verdict.reasons[0])
        return verdict

    def _run(self) -> None:
        while not self._stop.is_set():
            self.probe_once()
            self._stop.wait(self._interval_s)


# --- the HTTP server --------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(
        self,
        address: tuple[str, int],
        routes: Mapping[str, Callable[[], Answer]],
        *,
        max_connections: int,
        timeout_s: float,
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.routes = routes
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN (a DNS lookup): not needed here.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # full: close it rather than queue it
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.0"  # one answer per connection: nothing waits on keep-alive
    server_version = "kvindex-indexer"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.timeout_s)  # per socket read and write

    def do_GET(self) -> None:
        self._answer(with_body=True)

    def do_HEAD(self) -> None:
        self._answer(with_body=False)

    def do_POST(self) -> None:
        self._refuse()

    def do_PUT(self) -> None:
        self._refuse()

    def do_DELETE(self) -> None:
        self._refuse()

    def do_PATCH(self) -> None:
        self._refuse()

    def do_OPTIONS(self) -> None:
        self._refuse()

    def _refuse(self) -> None:
        if self._path() not in self.server.routes:
            self._send(_json({"status": "not found", "path": self._path()}, 404), True)
            return
        answer = _json({"status": "method not allowed", "method": self.command}, 405)
        self._send(answer, True, allow="GET, HEAD")

    def _path(self) -> str:
        return self.path.split("?", 1)[0]

    def _answer(self, *, with_body: bool) -> None:
        route = self.server.routes.get(self._path())
        if route is None:
            answer = _json({"status": "not found", "path": self._path()}, 404)
        else:
            try:
                answer = route()
            except Exception as exc:  # a bug must not kill the connection without an answer
                log.exception("status %s failed", self._path())
                answer = _json({"status": "error", "detail": str(exc)}, 500)
        self._send(answer, with_body)

    def _send(self, answer: Answer, with_body: bool, allow: str | None = None) -> None:
        self.send_response(answer.status)
        self.send_header("Content-Type", answer.content_type)
        self.send_header("Content-Length", str(len(answer.body)))
        if allow is not None:
            self.send_header("Allow", allow)
        self.end_headers()
        if with_body:
            self.wfile.write(answer.body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


def _json(body: Mapping[str, object], status: int = 200) -> Answer:
    return Answer(status, _JSON, json.dumps(body).encode())


class StatusServer:
    """An HTTP server answering ``routes`` (path → answer) in a daemon thread; ``start``
    raises :class:`StatusPortError` when it cannot bind."""

    def __init__(
        self,
        host: str,
        port: int,
        routes: Mapping[str, Callable[[], Answer]],
        *,
        max_connections: int = 32,
        timeout_s: float = 5.0,
    ) -> None:
        self._host, self._port = host, port
        self._routes = routes
        self._max_connections = max_connections
        self._timeout_s = timeout_s
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None, "not started"
        return self._server.server_name, self._server.server_port

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> None:
        try:
            self._server = _Server(
                (self._host, self._port),
                self._routes,
                max_connections=self._max_connections,
                timeout_s=self._timeout_s,
            )
        except OSError as exc:
            where = f"{self._host}:{self._port}"
            raise StatusPortError(
                f"status port {where}: {exc.strerror or exc} (status_port: another, 0 for any"
                " free one, -1 for none)"
            ) from exc
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.1,), name="kvindex-status", daemon=True
        )
        self._thread.start()
        log.info("status port on %s (/metrics, /healthz, /readyz)", self.url)

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5.0)
        self._server = None


# --- the indexer's status ---------------------------------------------------------------


@dataclass
class IndexerStatus:
    """The indexer's status port: its server and store probe; on Redis, over a connection
    of its own with a ``status_timeout_s`` timeout."""

    server: StatusServer
    probe: StoreProbe
    scrape_index: RedisIndex | None

    @classmethod
    def build(
        cls,
        settings: IndexerSettings,
        registry: RegistryView,
        index: BlockIndex,
        loop_alive: Callable[[], bool],
        discovered: Callable[[], DiscoveryCounts | None] = lambda: None,
    ) -> IndexerStatus:
        scrape_index = None
        probe = StoreProbe(None, interval_s=settings.status_probe_s)
        if isinstance(index, RedisIndex):
            client = connect_bounded(
                settings.redis_url,
                timeout_s=settings.status_timeout_s,
                cluster=settings.redis_cluster,
            )
            scrape_index = RedisIndex(client, index.schema)
            probe = StoreProbe(partial(ping, client), interval_s=settings.status_probe_s)
        read_index = index if scrape_index is None else scrape_index
        metrics = CollectorRegistry(auto_describe=False)
        metrics.register(IngestCollector(registry, read_index, store_up=probe.is_up))
        metrics.register(IndexerProcessCollector(probe.is_up, discovered=discovered))
        routes = status_routes(
            metrics, lambda: liveness(loop_alive), lambda: readiness(loop_alive, probe)
        )
        server = StatusServer(settings.status_host, settings.status_port, routes)
        return cls(server, probe, scrape_index)

    def start(self) -> None:
        self.probe.start()
        try:
            self.server.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.server.stop()
        self.probe.stop()
        if self.scrape_index is not None:
            self.scrape_index.close()


def liveness(loop_alive: Callable[[], bool]) -> Check:
    return Check(True) if loop_alive() else Check(False, ("subscriber loop not running",))


def readiness(loop_alive: Callable[[], bool], probe: StoreProbe) -> Check:
    reasons = liveness(loop_alive).reasons + probe.check().reasons
    return Check(not reasons, reasons)


def status_routes(
    metrics: CollectorRegistry, alive: Callable[[], Check], ready: Callable[[], Check]
) -> dict[str, Callable[[], Answer]]:
    return {
        "/metrics": lambda: Answer(200, CONTENT_TYPE_PLAIN_0_0_4, generate_latest(metrics)),
        "/healthz": lambda: _verdict(alive(), "ok", "unhealthy"),
        "/readyz": lambda: _verdict(ready(), "ready", "unavailable"),
    }


def _verdict(check: Check, good: str, bad: str) -> Answer:
    if check.ok:
        return _json({"status": good})
    return _json({"status": bad, "reasons": list(check.reasons)}, 503)
