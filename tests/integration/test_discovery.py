"""Discovery from Kubernetes with the real ``kubernetes`` client against a Kubernetes API
stand-in (:mod:`tests.support.kube_api`: no API server installs from the package registries
here), which serves lists and chunked watches by resourceVersion, a 410 Gone for a compacted
version, watches ended and dropped mid-stream.

- The picker (a subprocess, memory store) in front of replica-sims on 127.0.0.2 and 127.0.0.3,
  an InferencePool of two target ports (two data-parallel ranks a pod): a pod added not Ready
  is not named, named within 2 s of becoming Ready, no longer named within 2 s of its deletion.
- The indexer in process: its registry and subscriber follow the pods through a 410 Gone (a
  new list) and a dropped watch (resumed from its resourceVersion, no new list); once stopped,
  no thread, watch or connection to the API is left.
- On Redis, an indexer's or a picker's discovery writes the shared fleet every process reads."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvindex.indexer.config.settings import IndexerSettings, load_settings
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.fleet.view import RedisFleetView
from kvindex.indexer.redis.connection import connect
from kvindex.indexer.redis.schema import Schema
from kvindex.indexer.service import IndexerService
from tests.integration.test_proxy import MODEL
from tests.support.gateway import Gateway
from tests.support.kube_api import KubeApi, pod
from tests.support.processes import Child, http_ok, kvindex_child
from tests.support.redis_server import RedisServer, free_ports

pytestmark = pytest.mark.timeout(150)
HOSTS = {"pod-a": "127.0.0.2", "pod-b": "127.0.0.3"}
ROUTED_WITHIN_S = 2.0
CONFIG = """
[api]
health_check_interval_s = 0.2
health_check_timeout_s = 0.2

[picker]
num_endpoints = 4
"""


def _free_pair(hosts: list[str]) -> int:
    """A port p such that p and p + 1 are free on every host (an events port and rank 1's)."""
    for candidate in free_ports(40):
        socks: list[socket.socket] = []
        try:
            for host in hosts:
                for port in (candidate, candidate + 1):
                    sock = socket.socket()
                    socks.append(sock)
                    sock.bind((host, port))
            return candidate
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise AssertionError("no two consecutive free ports")


def _http_ok(host: str, port: int) -> Callable[[], bool]:
    def ready() -> bool:
        connection = http.client.HTTPConnection(host, port, timeout=0.5)
        try:
            connection.request("GET", "/health")
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()

    return ready


@dataclass
class Cluster:
    api: KubeApi
    gateway: Gateway
    http_ports: tuple[int, int]
    events_port: int

    def endpoints(self, pod_name: str) -> set[str]:
        return {f"{HOSTS[pod_name]}:{port}" for port in self.http_ports}

    def pod(self, name: str, *, ready: bool) -> dict[str, Any]:
        annotations = {"kvindex.io/model": MODEL, "kvindex.io/events-port": str(self.events_port)}
        return pod(name, HOSTS[name], ready=ready, annotations=annotations)

    def named(self) -> set[str]:
        """The endpoints the picker names for a chat request (none: it refused it)."""
        body = {"model": MODEL, "messages": [{"role": "user", "content": "where am I"}]}
        stream, picked = self.gateway.pick(body)
        stream.half_close()
        return set(picked.endpoints) if picked.header is not None else set()

    def until_named(self, wanted: set[str]) -> float:
        """Seconds until the picker names exactly ``wanted``."""
        start = time.monotonic()
        while (named := self.named()) != wanted:
            assert time.monotonic() - start < 20, f"named {named}, not {wanted}"
            time.sleep(0.02)
        return time.monotonic() - start


def _sim(pod_name: str, rank: int, http_port: int, events_port: int, workdir: Path) -> Child:
    host, rid = HOSTS[pod_name], pod_name if rank == 0 else f"{pod_name}-{rank}"
    args = [
        "replica-sim", "--id", rid, "--model", MODEL, "--host", host, "--port", str(http_port),
        "--events", f"tcp://{host}:{events_port + rank}", "--bind-events", "--replay", "",
        "--speed", "1000", "--seed", "7",
    ]  # fmt: skip
    return kvindex_child(f"sim {rid}", args, workdir / f"{rid}.log", _http_ok(host, http_port))


@contextmanager
def _cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Four replica-sims (two pods' two ranks), the API stand-in with an InferencePool, and a
    picker discovering its pods; everything stopped after."""
    api = KubeApi()
    hosts = list(HOSTS.values())
    first = _free_pair(hosts)
    http_ports = (first, first + 1)
    events_port = _free_pair(hosts)
    assert events_port not in (first - 1, first, first + 1)
    port, metrics_port = free_ports(2)
    config = tmp_path / "kvindex.toml"
    config.write_text(CONFIG)
    with ExitStack() as stack:
        stack.enter_context(api.running())
        api.put_pool("vllm", {"app": "vllm"}, list(http_ports))
        sims = [
            _sim(name, rank, http_ports[rank], events_port, tmp_path)
            for name in HOSTS
            for rank in (0, 1)
        ]
        for sim in sims:
            stack.callback(sim.stop)
            sim.spawn()
        for sim in sims:
            sim.wait_ready(40)
        args = ["picker", "--config", str(config), "--port", str(port)]
        args += ["--metrics-port", str(metrics_port), "--k8s-pool", "vllm"]
        args += [
            "--kubeconfig",
            str(api.kubeconfig(tmp_path / "kubeconfig")),
            "--k8s-namespace",
            "default",
        ]
        picker = kvindex_child(
            "picker", args, tmp_path / "picker.log", http_ok(metrics_port, "/readyz")
        )
        stack.callback(picker.stop)
        picker.start(40)
        gateway = Gateway(port)
        stack.callback(gateway.close)
        yield Cluster(api, gateway, http_ports, events_port)


def test_pods_added_becoming_ready_and_deleted_change_the_pickers_endpoints(tmp_path: Path) -> None:
    """Not Ready: not routed; Ready: routed, each target port a rank; deleted: not routed."""
    with _cluster(tmp_path) as cluster:
        assert cluster.named() == set()  # the pool selects no pod yet: 503
        cluster.api.put_pod(cluster.pod("pod-a", ready=False))
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert cluster.named() == set(), "a pod not Ready was routed"
        cluster.api.set_ready("pod-a", True)
        took = [cluster.until_named(cluster.endpoints("pod-a"))]
        cluster.api.put_pod(cluster.pod("pod-b", ready=True))
        took.append(cluster.until_named(cluster.endpoints("pod-a") | cluster.endpoints("pod-b")))
        cluster.api.delete_pod("pod-a")
        took.append(cluster.until_named(cluster.endpoints("pod-b")))
        cluster.api.set_ready("pod-b", False)
        took.append(cluster.until_named(set()))
        print(f"routing changed after {', '.join(f'{t:.2f}' for t in took)} s")
        assert max(took) <= ROUTED_WITHIN_S, took
        assert cluster.api.num_requests("list") == 1  # one list, then the watch alone


def _open_to(port: int) -> int:
    """Established TCP connections whose remote end is ``port`` (this process's clients)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[3] in ("01", "08"):
                    count += 1
    return count


def _until(condition: Callable[[], object], within_s: float) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < within_s, f"not within {within_s} s"
        time.sleep(0.01)
    return time.monotonic() - start


def test_the_indexer_follows_the_pods_through_410_and_a_drop_and_leaks_nothing(
    tmp_path: Path,
) -> None:
    api = KubeApi()
    with api.running():
        api_port = int(api.url.rsplit(":", 1)[1])
        api.put_pool("vllm", {"app": "vllm"}, [8000, 8001])
        discovery = {
            "pool": "vllm",
            "kubeconfig": str(api.kubeconfig(tmp_path / "kc")),
            "model": MODEL,
        }
        settings = load_settings(env={}, overrides={"status_port": -1}, discovery=discovery)
        service = IndexerService.build(settings)
        service.start()
        try:
            registry, subscriber = service.registry, service.subscriber

            def has(*ids: str) -> Callable[[], bool]:
                def check() -> bool:
                    known = {r.id for r in registry.replicas()}
                    return known == set(ids) and set(subscriber.subscribed_replicas) == set(ids)

                return check

            api.put_pod(pod("pod-a", "127.0.0.2", annotations={"kvindex.io/model": MODEL}))
            took = [_until(has("pod-a", "pod-a-1"), ROUTED_WITHIN_S)]
            assert registry.get("pod-a-1").events == "tcp://127.0.0.2:5558"  # type: ignore[union-attr]

            api.hold(True)  # the watcher falls behind, its version is compacted away: 410
            api.put_pod(pod("pod-b", "127.0.0.3"))
            api.compact()
            api.hold(False)
            api.end_watches()
            took.append(_until(has("pod-a", "pod-a-1", "pod-b", "pod-b-1"), ROUTED_WITHIN_S))
            assert api.num_requests("list") == 2

            api.end_watches(drop=True)  # cut mid-stream: resumed from the last version
            _until(lambda: api.num_requests("watch") >= 4, 5)
            api.delete_pod("pod-a")
            took.append(_until(has("pod-b", "pod-b-1"), ROUTED_WITHIN_S))
            assert api.num_requests("list") == 2
            versions = [q["resourceVersion"][0] for kind, q in api.requests if kind == "watch"]
            assert versions[-1] == versions[-2]  # the same version watched again after the drop

            # An undecodable event: the watch is not trusted after it, the pods are listed again.
            api.send_raw(b'{"type": "ADDED", "object": ["not", "a", "pod"]}')
            _until(lambda: api.num_requests("list") == 3, 5)
            api.put_pod(pod("pod-c", "127.0.0.4"))
            took.append(_until(has("pod-b", "pod-b-1", "pod-c", "pod-c-1"), ROUTED_WITHIN_S))
            print(f"registry changed after {', '.join(f'{t:.2f}' for t in took)} s")
            assert _open_to(api_port) >= 1
            counts = service.discovered()  # what kvindex_discovery_* export
            assert counts is not None
            assert (counts.replicas, counts.lists, counts.write_errors) == (4, 3, 0)
        finally:
            service.stop()
        assert service.discovery is not None and service.discovery.watch is not None
        assert service.discovery.watch.running is False
        names = {t.name for t in threading.enumerate()}
        assert not {"kvindex-pod-watch", "kvindex-discovery"} & names
        _until(lambda: api.num_open == 0 and _open_to(api_port) == 0, 5)


@pytest.mark.redis_server
def test_on_redis_the_shared_fleet_follows_the_pods(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """An indexer on Redis writes the pods' replicas to the shared fleet, which every API
    process reads, and its own subscriber follows the shared fleet (the fleet sync)."""
    api = KubeApi()
    with api.running():
        api.put_pool("vllm", {"app": "vllm"}, [8000])
        discovery = {
            "pool": "vllm",
            "kubeconfig": str(api.kubeconfig(tmp_path / "kc")),
            "model": MODEL,
        }
        overrides = {"status_port": -1, "store": "redis", "redis_url": redis_server.url}
        settings = load_settings(env={}, overrides=overrides, discovery=discovery)
        redis_server.client().flushall()
        service = IndexerService.build(settings)
        service.start()
        view = RedisFleetView(connect(redis_server.url, cluster="off"), settings.redis_schema)
        try:

            def fleet_is(*ids: str) -> Callable[[], bool]:
                def check() -> bool:
                    shared = {r.id for r in view.replicas()}
                    own = set(service.subscriber.subscribed_replicas)
                    return shared == set(ids) == own == {r.id for r in service.registry.replicas()}

                return check

            api.put_pod(pod("pod-a", "127.0.0.2"))
            api.put_pod(pod("pod-b", "127.0.0.3"))
            _until(fleet_is("pod-a", "pod-b"), 5)  # the fleet sync's period is 1 s
            api.delete_pod("pod-a")
            _until(fleet_is("pod-b"), 5)
        finally:
            service.stop()


@pytest.mark.redis_server
def test_a_restarted_indexer_removes_its_replicas_whose_pods_went_away_while_it_was_down(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Discovery's replicas live on in Redis after its indexer stops; the next one's first list
    removes those whose pods are gone, and only those: a declared replica and another
    discovery's stay."""
    api = KubeApi()
    with api.running():
        api.put_pool("vllm", {"app": "vllm"}, [8000])
        discovery = {
            "pool": "vllm",
            "kubeconfig": str(api.kubeconfig(tmp_path / "kc")),
            "model": MODEL,
        }
        overrides = {"status_port": -1, "store": "redis", "redis_url": redis_server.url}
        static = ReplicaSpec("static", MODEL, events="tcp://127.0.0.9:5557")
        settings = load_settings(
            env={}, overrides=overrides, discovery=discovery, extra_replicas=(static,)
        )
        redis_server.client().flushall()
        view = RedisFleetView(
            connect(redis_server.url, cluster="off"), settings.redis_schema, cache_ttl_s=0.0
        )
        api.put_pod(pod("pod-a", "127.0.0.2"))
        api.put_pod(pod("pod-b", "127.0.0.3"))
        with _indexer(settings):
            _until(lambda: {r.id for r in view.replicas()} == {"pod-a", "pod-b", "static"}, 5)
        view.add(ReplicaSpec("elsewhere", MODEL, events="tcp://127.0.0.8:5557"))
        view.mark_discovered("elsewhere", "default/pool/another")
        api.delete_pod("pod-a")  # while no indexer runs
        assert {r.id for r in view.replicas()} == {"elsewhere", "pod-a", "pod-b", "static"}
        with _indexer(settings) as service:
            kept = {"elsewhere", "pod-b", "static"}
            _until(lambda: {r.id for r in view.replicas()} == kept, 5)
            _until(lambda: {r.id for r in service.registry.replicas()} == kept, 5)
            assert view.discovered("default/pool/vllm") == {"pod-b"}
            assert view.discovered("default/pool/another") == {"elsewhere"}


@contextmanager
def _indexer(settings: IndexerSettings) -> Iterator[IndexerService]:
    service = IndexerService.build(settings)
    service.start()
    try:
        yield service
    finally:
        service.stop()


@pytest.mark.redis_server
def test_a_picker_on_redis_writes_the_pods_to_the_shared_fleet(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """``kvindex picker --store redis`` runs no indexer: its discovery writes the fleet that
    the indexers subscribe from; the API server sees no connection once it stopped."""
    api = KubeApi()
    with api.running():
        api.put_pool("vllm", {"app": "vllm"}, [8000])
        redis_server.client().flushall()
        view = RedisFleetView(connect(redis_server.url, cluster="off"), Schema())
        port, metrics_port = free_ports(2)
        args = ["picker", "--port", str(port), "--metrics-port", str(metrics_port)]
        args += ["--store", "redis", "--redis-url", redis_server.url, "--k8s-pool", "vllm"]
        args += ["--k8s-model", MODEL, "--kubeconfig", str(api.kubeconfig(tmp_path / "kc"))]
        log = tmp_path / "picker.log"
        picker = kvindex_child("picker", args, log, http_ok(metrics_port, "/readyz"))
        try:
            picker.start(40)
            api.put_pod(pod("pod-a", "127.0.0.2"))
            _until(lambda: [r.id for r in view.replicas()] == ["pod-a"], ROUTED_WITHIN_S)
            assert view.get("pod-a") is not None
            api.delete_pod("pod-a")
            _until(lambda: view.replicas() == [], ROUTED_WITHIN_S)
        finally:
            picker.stop()
        _until(lambda: api.num_open == 0, 5)
