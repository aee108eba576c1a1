"""A real 3-master Redis Cluster on loopback, started and stopped by tests.

Three ``redis-server --cluster-enabled yes`` on free ports (each ≤ 55535: a node's cluster
bus listens on its port + 10000), joined by ``redis-cli --cluster create`` with no replicas;
ready once every node reports ``cluster_state:ok``. Stopping it ends the three processes
and removes their work directories.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.cluster import RedisCluster

from tests.support.redis_server import bindable, ephemeral_low, stop_process

NUM_MASTERS = 3
BUS_OFFSET = 10_000
MAX_PORT = 65_535 - BUS_OFFSET


def free_cluster_port(taken: set[int], *, attempts: int = 200) -> int:
    """A loopback port ≤ :data:`MAX_PORT` that is free, and whose bus port (+10000) is too."""
    for _ in range(attempts):
        port = random.randint(ephemeral_low(), MAX_PORT)  # not among the tests' own ports
        if port in taken or port + BUS_OFFSET in taken:
            continue
        if bindable(port) and bindable(port + BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair (port, port + 10000) on loopback")


@dataclass
class ClusterNodes:
    """The running nodes of one test cluster (all masters)."""

    ports: list[int]
    processes: list[subprocess.Popen[bytes]]

    @property
    def url(self) -> str:
        """The URL of one node (kvindex is given one and finds the others)."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def client(self) -> RedisCluster:
        return RedisCluster(host="127.0.0.1", port=self.ports[0])

    def node(self, port: int) -> redis.Redis:
        """A plain client of one node (to look at what that master holds)."""
        return redis.Redis(host="127.0.0.1", port=port)

    def num_keys_per_master(self) -> dict[int, int]:
        """Port → the number of keys that master holds."""
        out = {}
        for port in self.ports:
            with self.node(port) as client:
                out[port] = int(client.dbsize())
        return out

    def owner(self, slot: int) -> int:
        """The port of the master serving ``slot`` (as the nodes see it now)."""
        with self.node(self.ports[0]) as client:
            ranges = client.execute_command("CLUSTER", "SLOTS")
        for start, end, master, *_ in ranges:
            if int(start) <= slot <= int(end):
                return int(master[1])
        raise RuntimeError(f"slot {slot} is not served")

    def move_slot(self, slot: int) -> int:
        """Migrate ``slot`` and its keys to another master, as a resharding does (clients
        with the old slot map get MOVED); returns the new master's port."""
        source = self.owner(slot)
        target = next(p for p in self.ports if p != source)
        ids = {}
        for port in self.ports:
            with self.node(port) as client:
                ids[port] = client.execute_command("CLUSTER", "MYID").decode()
        with self.node(source) as src, self.node(target) as dst:
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10_000)
            if keys:
                src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
        for port in self.ports:
            with self.node(port) as client:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])
        return target

    def stop(self) -> None:
        for process in self.processes:
            stop_process(process)


def _spawn(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (CI installs it: .ci/run)")
    workdir.mkdir()
    args = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        str(workdir / "nodes.conf"),
        "--cluster-node-timeout",
        "5000",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
    ]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _ping(port: int) -> bool:
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
    finally:
        client.close()


def _state_ok(port: int) -> bool:
    with redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2) as client:
        info = client.execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text


def _wait(nodes: ClusterNodes, check: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    probe = _ping if check == "ping" else _state_ok
    pending = list(nodes.ports)
    while pending:
        for process in nodes.processes:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {process.returncode}")
        pending = [p for p in pending if not probe(p)]
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"redis cluster nodes {pending} not ready ({check})")
        if pending:
            time.sleep(0.05)


def _create(ports: list[int]) -> None:
    binary = shutil.which("redis-cli")
    if binary is None:
        raise RuntimeError("redis-cli is not installed (it comes with redis-server)")
    nodes = [f"127.0.0.1:{port}" for port in ports]
    args = [binary, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"]
    done = subprocess.run(args, capture_output=True, timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout!r} {done.stderr!r}")


@contextmanager
def running_cluster(timeout_s: float = 30.0) -> Iterator[ClusterNodes]:
    """Start a private 3-master cluster on loopback; stop it and remove its files on exit."""
    with ExitStack() as cleanup:
        tmp = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="kvindex-cluster-")))
        nodes = ClusterNodes([], [])
        cleanup.callback(nodes.stop)
        taken: set[int] = set()
        for i in range(NUM_MASTERS):
            port = free_cluster_port(taken)
            taken |= {port, port + BUS_OFFSET}
            nodes.ports.append(port)
            nodes.processes.append(_spawn(port, tmp / f"node-{i}"))
        _wait(nodes, "ping", timeout_s)
        _create(nodes.ports)
        _wait(nodes, "state", timeout_s)
        yield nodes
