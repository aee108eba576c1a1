"""A Kubernetes API stand-in on loopback for the discovery tests: pods and InferencePools in
memory, answered as the API server answers them — lists with a resourceVersion, watches as
chunked JSON lines from a resourceVersion on (``timeoutSeconds`` honoured), an ERROR event with
410 Gone when that version was compacted away — and faults on demand: open watches ended
(as at a watch timeout) or dropped mid-stream. Every connection is counted while open."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/"


@dataclass
class _Event:
    version: int
    type: str
    pod: dict[str, Any]
    raw: bytes | None = None  # sent as is instead of the event (a line no decoder reads)


def pod(
    name: str,
    ip: str,
    *,
    ready: bool = True,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    namespace: str = "default",
) -> dict[str, Any]:
    """A pod object as the API server returns it (the fields discovery reads, and a few more)."""
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            "labels": labels if labels is not None else {"app": "vllm"},
            "annotations": annotations or {},
        },
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True" if ready else "False"},
            ],
        },
    }


class KubeApi:
    """The server; :meth:`running` serves it in a thread and stops it (no connection left)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._version = 1000
        self._compacted = 0
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._pools: dict[tuple[str, str], dict[str, Any]] = {}
        self._events: list[_Event] = []
        self._generation = 0  # bumped to end (or drop) every open watch
        self._drop = False
        self._held = False
        self._closing = False
        self.requests: list[tuple[str, dict[str, list[str]]]] = []
        self.num_open = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig naming this server (no credentials: none are asked)."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {}}],
            "contexts": [
                {
                    "name": "test",
                    "context": {"cluster": "test", "user": "test", "namespace": namespace},
                }
            ],
            "current-context": "test",
        }
        path.write_text(json.dumps(config))  # JSON is YAML
        return path

    @contextmanager
    def running(self) -> Iterator[KubeApi]:
        thread = threading.Thread(target=self.server.serve_forever, name="kube-api", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self.server.shutdown()
            self.server.server_close()
            thread.join(5)

    # --- the state a test changes ------------------------------------------------------

    def put_pool(
        self, name: str, labels: dict[str, str], ports: list[int], ns: str = "default"
    ) -> None:
        spec = {"selector": {"matchLabels": labels}, "targetPorts": [{"number": p} for p in ports]}
        with self._cond:
            self._pools[(ns, name)] = {
                "kind": "InferencePool",
                "metadata": {"name": name},
                "spec": spec,
            }

    def put_pod(self, obj: dict[str, Any]) -> None:
        """Create or replace a pod (ADDED or MODIFIED to the watches)."""
        meta = obj["metadata"]
        key = (meta["namespace"], meta["name"])
        with self._cond:
            kind = "MODIFIED" if key in self._pods else "ADDED"
            self._pods[key] = self._record(kind, obj)

    def set_ready(self, name: str, ready: bool, ns: str = "default") -> None:
        with self._cond:
            obj = json.loads(json.dumps(self._pods[(ns, name)]))
        for condition in obj["status"]["conditions"]:
            if condition["type"] == "Ready":
                condition["status"] = "True" if ready else "False"
        self.put_pod(obj)

    def delete_pod(self, name: str, ns: str = "default") -> None:
        with self._cond:
            self._record("DELETED", self._pods.pop((ns, name)))

    def _record(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        self._version += 1
        stored: dict[str, Any] = json.loads(json.dumps(obj))
        stored["metadata"]["resourceVersion"] = str(self._version)
        self._events.append(_Event(self._version, kind, stored))
        self._cond.notify_all()
        return stored

    def send_raw(self, line: bytes) -> None:
        """Send ``line`` to the open watches as if it were an event."""
        with self._cond:
            self._events.append(_Event(self._version, "RAW", {}, line))
            self._cond.notify_all()

    def hold(self, held: bool) -> None:
        """While held, open watches send nothing (a watcher falling behind)."""
        with self._cond:
            self._held = held
            self._cond.notify_all()

    def compact(self) -> None:
        """Forget the history so far: a watch from an older version gets 410 Gone."""
        with self._cond:
            self._compacted = self._version
            self._events.clear()

    def end_watches(self, *, drop: bool = False) -> None:
        """End every open watch as a server-side timeout does (``drop``: cut mid-stream)."""
        with self._cond:
            self._generation += 1
            self._drop = drop
            self._cond.notify_all()

    def num_requests(self, kind: str) -> int:
        """Requests so far of ``kind``: ``list``, ``watch`` or ``pool``."""
        return sum(k == kind for k, _ in self.requests)

    # --- answers (handler threads) -----------------------------------------------------

    def list_pods(self, ns: str, selector: str) -> dict[str, Any]:
        with self._cond:
            items = [
                p for (n, _), p in sorted(self._pods.items()) if n == ns and _selects(selector, p)
            ]
            version = self._version
        return {
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(version)},
            "items": items,
        }

    def pool(self, ns: str, name: str) -> dict[str, Any] | None:
        with self._cond:
            found: dict[str, Any] | None = self._pools.get((ns, name))
            return found

    def watch(
        self, ns: str, selector: str, since: int, seconds: float, gone: Callable[[], bool]
    ) -> Iterator[dict[str, Any] | bytes | None]:
        """The watch's events in order; None last if it is to be dropped, not ended. ``gone``:
        the client closed its end (checked while waiting, as a write would find it)."""
        deadline = time.monotonic() + seconds
        with self._cond:
            generation = self._generation
            if since < self._compacted:
                yield _gone(since, self._compacted)
                return
        sent = since
        while True:
            new = self._wait_events(sent, generation, deadline, gone)
            if new is None:
                return
            if not new:  # ended by end_watches
                if self._drop and not self._closing:
                    yield None
                return
            for event in new:
                if event.raw is not None:
                    yield event.raw
                    continue
                sent = event.version
                if event.pod["metadata"]["namespace"] == ns and _selects(selector, event.pod):
                    yield {"type": event.type, "object": event.pod}

    def _wait_events(
        self, sent: int, generation: int, deadline: float, gone: Callable[[], bool]
    ) -> list[_Event] | None:
        """The events after ``sent`` (a raw line taken: it goes to one watch only); [] when
        the watches are ended; None at the watch's timeout or once its client is gone."""
        with self._cond:
            while True:
                new = [] if self._held else [e for e in self._events if e.version > sent or e.raw]
                if new or self._closing or self._generation != generation:
                    self._events = [e for e in self._events if e.raw is None]
                    return new
                left = deadline - time.monotonic()
                if left <= 0 or gone():
                    return None
                self._cond.wait(min(left, 0.05))


def _gone(since: int, oldest: int) -> dict[str, Any]:
    message = f"too old resource version: {since} ({oldest})"
    status = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": "Expired",
        "code": 410,
    }
    return {"type": "ERROR", "object": status}


def _selects(selector: str, obj: dict[str, Any]) -> bool:
    labels = obj["metadata"].get("labels") or {}
    wanted = dict(part.split("=", 1) for part in selector.split(",") if part)
    return all(labels.get(k) == v for k, v in wanted.items())


def _handler(api: KubeApi) -> type[BaseHTTPRequestHandler]:
    return type("Handler", (_Handler,), {"api": api})


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    api: KubeApi  # set by _handler

    def setup(self) -> None:
        super().setup()
        with self.api._cond:
            self.api.num_open += 1

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            with self.api._cond:
                self.api.num_open -= 1

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        query = parse_qs(parts.query)
        path = parts.path.strip("/").split("/")
        if self.path.startswith(POOLS) and len(path) == 7 and path[5] == "inferencepools":
            self._pool(path[4], path[6])
        elif path[:3] == ["api", "v1", "namespaces"] and len(path) == 5 and path[4] == "pods":
            self._pods(path[3], query)
        else:
            self._json(404, {"kind": "Status", "code": 404, "reason": "NotFound"})

    def _pool(self, ns: str, name: str) -> None:
        self.api.requests.append(("pool", {}))
        found = self.api.pool(ns, name)
        if found is None:
            self._json(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
        else:
            self._json(200, found)

    def _pods(self, ns: str, query: dict[str, list[str]]) -> None:
        selector = query.get("labelSelector", [""])[0]
        if query.get("watch", [""])[0].lower() not in ("true", "t", "1"):  # Go's ParseBool
            self.api.requests.append(("list", query))
            self._json(200, self.api.list_pods(ns, selector))
            return
        self.api.requests.append(("watch", query))
        since = int(query.get("resourceVersion", ["0"])[0] or 0)
        seconds = float(query.get("timeoutSeconds", ["30"])[0])
        self._stream(self.api.watch(ns, selector, since, seconds, self._gone))

    def _gone(self) -> bool:
        readable, _, _ = select.select([self.connection], [], [], 0)
        return bool(readable) and not self.connection.recv(1, socket.MSG_PEEK)

    def _json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, events: Iterator[dict[str, Any] | bytes | None]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        try:
            for event in events:
                if event is None:  # dropped: no last chunk, the connection cut
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                line = (event if isinstance(event, bytes) else json.dumps(event).encode()) + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:  # the client went away
            self.close_connection = True
