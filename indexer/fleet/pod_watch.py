"""``PodWatch``: the target's pods listed, then watched from the list's resourceVersion, with
the ``kubernetes`` client in a thread; 410 Gone lists again, a dropped watch resumes."""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import msgspec

from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.fleet.pods import (
    InferencePool,
    Pod,
    PodError,
    PodList,
    Status,
    Target,
    WatchEvent,
    pool_target,
)
from kvindex.indexer.fleet.settings import DiscoverySettings

log = logging.getLogger("kvindex.discovery")

POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
INSTALL_HINT = "discovery needs the kubernetes client: pip install 'kvindex[k8s]'"
CONNECT_TIMEOUT_S = 5.0
LIST_TIMEOUT_S = 30.0
WATCH_S = (60, 120)  # a watch's server-side timeout is drawn in this range (spreads re-watches)
BACKOFF_S = (0.5, 30.0)
SHORT_WATCH_S = 1.0  # a watch ended this soon without an event is waited out as an error


class DiscoveryError(KvIndexError):
    """Discovery cannot start: no client library, or no usable kubeconfig."""


class _GoneError(Exception):
    """The resourceVersion watched from is too old (410): list again."""


class PodSink(Protocol):
    """What the watch tells, from its thread: every pod after a list (target None: the pool
    is gone), then each change."""

    def reset(self, pods: list[Pod], target: Target | None) -> None: ...

    def update(self, pod: Pod) -> None: ...

    def delete(self, pod: Pod) -> None: ...


class Backoff:
    """Doubling from ``bounds[0]`` to ``bounds[1]``, each wait jittered down to half."""

    def __init__(self, bounds: tuple[float, float] = BACKOFF_S) -> None:
        self._low, self._high = bounds
        self._failures = 0

    def next_wait(self) -> float:
        wait = min(self._high, self._low * 2.0**self._failures)
        self._failures += 1
        return wait * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self._failures = 0


def own_namespace(path: Path = NAMESPACE_FILE) -> str:
    """The namespace of the pod this runs in (its service account's), else ``default``."""
    try:
        return path.read_text().strip() or "default"
    except OSError:
        return "default"


def api_client(settings: DiscoverySettings) -> Any:
    """A ``kubernetes.client.ApiClient``: ``settings.kubeconfig``, else the pod's service
    account, else the default kubeconfig; DiscoveryError naming what is missing."""
    try:
        from kubernetes import client, config  # noqa: PLC0415 (an optional extra)
    except ImportError as exc:
        raise DiscoveryError(INSTALL_HINT) from exc
    configuration = client.Configuration()
    try:
        if settings.kubeconfig:
            config.load_kube_config(settings.kubeconfig, client_configuration=configuration)
        elif "KUBERNETES_SERVICE_HOST" in os.environ:
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(client_configuration=configuration)
    except (config.ConfigException, OSError, ValueError) as exc:
        raise DiscoveryError(f"discovery: no usable Kubernetes config: {exc}") from None
    return client.ApiClient(configuration)


class PodWatch:
    """Lists and watches the pods of ``settings`` (pool or selector) into ``sink``.
    :meth:`start` runs it in a daemon thread; :meth:`stop` ends the watch open, joins it."""

    def __init__(
        self,
        settings: DiscoverySettings,
        sink: PodSink,
        client: Any,
        *,
        namespace: str | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        from kubernetes import client as k8s  # noqa: PLC0415 (an optional extra)
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

        self._settings = settings
        self._sink = sink
        self._client = client
        self._pods_api = k8s.CoreV1Api(client)
        self._pools_api = k8s.CustomObjectsApi(client)
        self._api_error = ApiException
        self.namespace = namespace or settings.namespace or own_namespace()
        self._backoff = backoff or Backoff()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._open: Any = None  # the watch response being read, to cut on stop
        self._open_lock = threading.Lock()
        self._target: Target | None = None
        self._version: str | None = None  # None: list (again) before watching
        self.num_errors = 0
        self.num_lists = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvindex-pod-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with self._open_lock:
            if self._open is not None:
                _cut(self._open)
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the pod watch did not stop within %.0f s", timeout_s)
        self._client.close()
        self._client.rest_client.pool_manager.clear()  # older clients' close leaves it open

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except _GoneError:
                log.info("watch resourceVersion expired (410 Gone): listing again")
                self._version = None
            except Exception as exc:  # any failure of the API or of its answers is waited out
                if self._stop.is_set():
                    break
                self.num_errors += 1
                wait = self._backoff.next_wait()
                log.warning("kubernetes API: %s; again in %.1f s", _describe(exc), wait)
                self._stop.wait(wait)

    def run_once(self) -> None:
        target = self._read_target()
        if target != self._target or self._version is None:
            self._list(target)
        try:
            self._watch(target)
        except self._api_error as exc:
            if exc.status == 410:  # refused at once rather than as an ERROR event
                raise _GoneError from None
            raise

    # --- the target --------------------------------------------------------------------

    def _read_target(self) -> Target:
        if not self._settings.pool:
            return Target(self._settings.selector, self._settings.ports)
        try:
            raw = _body(self._pools_api.get_namespaced_custom_object(
                POOL_GROUP, POOL_VERSION, self.namespace, POOL_PLURAL, self._settings.pool,
                _preload_content=False, _request_timeout=(CONNECT_TIMEOUT_S, LIST_TIMEOUT_S),
            ))  # fmt: skip
            return pool_target(msgspec.json.decode(raw, type=InferencePool))
        except self._api_error as exc:
            if exc.status != 404:
                raise
            reason = f"InferencePool {self.namespace}/{self._settings.pool} not found"
        except (PodError, msgspec.DecodeError) as exc:
            reason = f"InferencePool {self.namespace}/{self._settings.pool}: {exc}"
        self._sink.reset([], None)  # no pool, no pods to route to
        self._target, self._version = None, None
        raise KvIndexError(reason)

    # --- list and watch ----------------------------------------------------------------

    def _list(self, target: Target) -> None:
        raw = _body(self._pods_api.list_namespaced_pod(
            self.namespace, label_selector=target.selector,
            _preload_content=False, _request_timeout=(CONNECT_TIMEOUT_S, LIST_TIMEOUT_S),
        ))  # fmt: skip
        found = msgspec.json.decode(raw, type=PodList)
        if target != self._target:
            log.info(
                "watching pods %r in %s, ports %s", target.selector, self.namespace, target.ports
            )
        self._sink.reset(found.items, target)
        self._target, self._version = target, found.metadata.resource_version
        self.num_lists += 1
        self._backoff.reset()

    def _watch(self, target: Target) -> None:
        seconds = random.randint(*WATCH_S)
        response = self._pods_api.list_namespaced_pod(
            self.namespace, label_selector=target.selector, watch=True,
            resource_version=self._version, timeout_seconds=seconds, allow_watch_bookmarks=True,
            _preload_content=False, _request_timeout=(CONNECT_TIMEOUT_S, seconds + 15),
        )  # fmt: skip
        with self._open_lock:
            self._open = response
        started, num_events = time.monotonic(), 0
        try:
            if self._stop.is_set():
                return
            for line in _lines(response):
                num_events += 1
                try:
                    event = msgspec.json.decode(line, type=WatchEvent)
                    self._on_event(event)
                except msgspec.DecodeError:  # (ValidationError is one) the stream can't be trusted
                    self._version = None  # so list again, after the back-off
                    raise
            if not num_events and time.monotonic() - started < SHORT_WATCH_S:
                raise KvIndexError("the watch ended at once, with no event")  # not a busy loop
        finally:
            with self._open_lock:
                self._open = None
            response.close()  # as the library's own Watch does: a watch's connection is not reused
            response.release_conn()

    def _on_event(self, event: WatchEvent) -> None:
        if event.type == "ERROR":
            status = msgspec.json.decode(event.object, type=Status)
            if status.code == 410:
                raise _GoneError
            raise KvIndexError(f"watch error {status.code} {status.reason}: {status.message}")
        pod = msgspec.json.decode(event.object, type=Pod)
        if pod.metadata.resource_version:
            self._version = pod.metadata.resource_version
        self._backoff.reset()
        if event.type in ("ADDED", "MODIFIED"):
            self._sink.update(pod)
        elif event.type == "DELETED":
            self._sink.delete(pod)


def _body(response: Any) -> bytes:
    try:
        return bytes(response.data)
    finally:
        response.release_conn()


def _lines(response: Any) -> Iterator[str]:
    from kubernetes.watch.watch import iter_resp_lines  # noqa: PLC0415

    for line in iter_resp_lines(response):
        if line.strip():
            yield line


def _cut(response: Any) -> None:
    # Wakes the thread blocked reading it.
    shutdown: Callable[[], None] | None = getattr(response, "shutdown", None)
    try:
        if shutdown is not None:
            shutdown()
            return
        sock = getattr(getattr(response, "connection", None), "sock", None)
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


def _describe(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    if status in (401, 403):
        return (
            f"{status} {getattr(exc, 'reason', '')}: the service account needs get, list and"
            " watch on pods (and on inferencepools.inference.networking.k8s.io)"
        )
    if status is not None:
        return f"{status} {getattr(exc, 'reason', '')}".strip()
    return str(exc) or type(exc).__name__
