"""``Discovery``: the routable pods' replicas kept registered in a :class:`RegistryView`; a
thread of its own writes (a store down is retried each second, the watch never waits), and
removes only what it added. On a view that keeps a :class:`DiscoveryLedger` (Redis), what it
added outlives the process: the first full list after a start removes the replicas the same
discovery (namespace, pool or selector) added whose pods went away while it was not running."""

from __future__ import annotations

import logging
import threading
from typing import Any, NamedTuple

from kvindex.indexer.fleet.pod_watch import PodWatch, api_client
from kvindex.indexer.fleet.pods import Pod, PodError, Target, replicas_of
from kvindex.indexer.fleet.registry import DiscoveryLedger, RegistryView
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.fleet.settings import DiscoverySettings

log = logging.getLogger("kvindex.discovery")
RETRY_S = 1.0


class DiscoveryCounts(NamedTuple):
    """What discovery has done so far (the indexer's ``kvindex_discovery_*``)."""

    replicas: int
    skipped_pods: int
    write_errors: int
    api_errors: int
    lists: int


class Discovery:
    """A watch's ``PodSink``, thread-safe; :meth:`apply` writes to ``view``."""

    def __init__(self, settings: DiscoverySettings, view: RegistryView) -> None:
        self._settings = settings
        self._view = view
        self._lock = threading.Lock()
        self._wanted: dict[str, tuple[ReplicaSpec, ...]] = {}  # pod name → its replicas
        self._ports: tuple[int, ...] = ()
        self._refused: dict[str, str] = {}  # pod name → why it makes no replicas
        self._applied: dict[str, ReplicaSpec] = {}  # what this process wrote (its thread's)
        self._ledger = view if isinstance(view, DiscoveryLedger) else None
        self._listed = False  # a full list came (the sink's)
        self._swept = self._ledger is None  # the ledger's gone replicas removed (the writer's)
        self._changed = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.watch: PodWatch | None = None
        self.num_skipped_pods = 0
        self.num_write_errors = 0

    # --- the sink (the watch's thread) -------------------------------------------------

    def reset(self, pods: list[Pod], target: Target | None) -> None:
        with self._lock:
            self._listed = True
            self._ports = () if target is None else target.ports
            self._wanted = {}
            for pod in pods:
                self._wanted[pod.metadata.name] = self._replicas(pod)
        self._changed.set()

    def update(self, pod: Pod) -> None:
        with self._lock:
            self._wanted[pod.metadata.name] = self._replicas(pod)
        self._changed.set()

    def delete(self, pod: Pod) -> None:
        with self._lock:
            self._wanted.pop(pod.metadata.name, None)
            self._refused.pop(pod.metadata.name, None)
        self._changed.set()

    def _replicas(self, pod: Pod) -> tuple[ReplicaSpec, ...]:
        name = pod.metadata.name
        try:
            specs = replicas_of(pod, self._ports, self._settings.model)
        except PodError as exc:
            if self._refused.get(name) != str(exc):  # once per pod and reason
                self.num_skipped_pods += 1
                log.warning("skipped: %s", exc)
            self._refused[name] = str(exc)
            return ()
        self._refused.pop(name, None)
        return specs

    def counts(self) -> DiscoveryCounts:
        watch = self.watch
        return DiscoveryCounts(
            replicas=len(self._applied),
            skipped_pods=self.num_skipped_pods,
            write_errors=self.num_write_errors,
            api_errors=0 if watch is None else watch.num_errors,
            lists=0 if watch is None else watch.num_lists,
        )

    def wanted(self) -> dict[str, ReplicaSpec]:
        with self._lock:
            return {s.id: s for specs in self._wanted.values() for s in specs}

    @property
    def source(self) -> str:
        """This discovery in a shared fleet's ledger: its namespace, then its pool or selector."""
        settings, watch = self._settings, self.watch
        namespace = settings.namespace if watch is None else watch.namespace
        if settings.pool:
            return f"{namespace}/pool/{settings.pool}"
        return f"{namespace}/selector/{settings.selector}"

    # --- the writer (its own thread) ---------------------------------------------------

    def apply(self) -> bool:
        """Write what changed since the last call; False if a write failed (retried later)."""
        self._changed.clear()
        with self._lock:
            listed = self._listed
        wanted = self.wanted()
        ok = self._swept or not listed or self._write(self._sweep, wanted)
        for replica in [r for r in self._applied if r not in wanted]:
            ok = self._write(self._remove, replica) and ok
        for spec in wanted.values():
            if self._applied.get(spec.id) != spec:
                ok = self._write(self._add, spec) and ok
        return ok

    def _sweep(self, wanted: dict[str, ReplicaSpec]) -> None:
        """Remove what this discovery added before this process and is not wanted now."""
        assert self._ledger is not None
        for replica in sorted(self._ledger.discovered(self.source) - wanted.keys()):
            if replica not in self._applied:
                self._view.remove(replica)
                self._ledger.unmark_discovered(replica)
                log.info("replica %s removed: its pod went away while discovery was off", replica)
        self._swept = True

    def _remove(self, replica: str) -> None:
        self._view.remove(replica)
        if self._ledger is not None:  # after the removal: a failure between retries it
            self._ledger.unmark_discovered(replica)
        del self._applied[replica]
        log.info("replica %s removed: its pod is gone or not ready", replica)

    def _add(self, spec: ReplicaSpec) -> None:
        if self._ledger is not None:  # before the spec: a failure between is swept later
            self._ledger.mark_discovered(spec.id, self.source)
        if spec.id in self._applied:  # removed first: its sockets open again on the new spec
            self._view.remove(spec.id)
        self._view.add(spec)
        self._applied[spec.id] = spec
        log.info(
            "replica %s added (%s, model %s, events %s)", spec.id, spec.url, spec.model, spec.events
        )

    def _write(self, change: Any, arg: Any) -> bool:
        try:
            change(arg)
        except Exception as exc:  # a store down, or any other failure: logged, retried
            self.num_write_errors += 1
            log.warning("discovery: the fleet could not be changed (retrying): %s", exc)
            return False
        return True

    def _run(self) -> None:
        ok = True
        while not self._stopping.is_set():
            self._changed.wait(None if ok else RETRY_S)
            if self._stopping.is_set():
                break
            ok = self.apply()

    # --- lifecycle ---------------------------------------------------------------------

    def start(self, client: Any | None = None) -> None:
        """Start the watch (on ``client``, else one from the settings) and the writer."""
        self.watch = PodWatch(self._settings, self, client or api_client(self._settings))
        self._thread = threading.Thread(target=self._run, name="kvindex-discovery", daemon=True)
        self._thread.start()
        self.watch.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the watch and the writer; the replicas added stay registered (a restart
        lists the pods again and corrects them: with a ledger, those of pods gone removed)."""
        if self.watch is not None:
            self.watch.stop(timeout_s)
        self._stopping.set()
        self._changed.set()
        if self._thread is not None:
            self._thread.join(timeout_s)


def start_discovery(settings: DiscoverySettings, view: RegistryView) -> Discovery | None:
    """A running discovery into ``view`` when the settings ask for one (None otherwise)."""
    if not settings.enabled:
        return None
    discovery = Discovery(settings, view)
    discovery.start()
    return discovery
