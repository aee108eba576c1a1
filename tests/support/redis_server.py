"""A real ``redis-server`` on a free loopback port, started and stopped by tests."""

from __future__ import annotations

import collections
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis


def free_port() -> int:
    return free_ports(1)[0]


_HANDED_OUT: collections.OrderedDict[int, None] = collections.OrderedDict()
"""Ports this process handed out lately (oldest first), never handed out again while kept."""
_NUM_REMEMBERED = 2048


def _share() -> tuple[int, int]:
    # (this test process's index, how many run at once): under pytest-xdist a worker hands
    # out only the ports its index is modulo their count, so no two hand out the same one.
    index = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    return int(index), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports, none handed out lately by this process (nor
    ever by another worker of the run): a port chosen and released before its server bound
    it could otherwise come back for another (each call's sockets are held until all are
    chosen, the ones skipped too)."""
    socks: list[socket.socket] = []
    chosen: list[int] = []
    index, num_workers = _share()
    try:
        while len(chosen) < count and len(socks) < num_workers * (count + _NUM_REMEMBERED):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
            if port not in _HANDED_OUT and port % num_workers == index:
                chosen.append(port)
    finally:
        for sock in socks:
            sock.close()
    for port in chosen:
        _HANDED_OUT[port] = None
        if len(_HANDED_OUT) > _NUM_REMEMBERED:
            _HANDED_OUT.popitem(last=False)
    return chosen


@dataclass
class RedisServer:
    port: int
    process: subprocess.Popen[bytes]
    workdir: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port)

    def stop(self) -> None:
        stop_process(self.process)

    def restart(self) -> None:
        """Stop and start again on the same port (data is not kept)."""
        self.stop()
        self.process = _spawn(self.port, self.workdir)
        _wait_ready(self.port, self.process)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """Terminate a redis-server (killed if it has not exited within 5 s)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _spawn(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (CI installs it: .ci/run)")
    args = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
        "--protected-mode",
        "yes",
    ]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_ready(port: int, process: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {process.returncode}")
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not become ready")
    finally:
        client.close()


@contextmanager
def running_redis() -> Iterator[RedisServer]:
    """Start a private redis-server on a free loopback port; stop it on exit."""
    with tempfile.TemporaryDirectory(prefix="kvindex-redis-") as tmp:
        port = free_port()
        process = _spawn(port, Path(tmp))
        server = RedisServer(port, process, Path(tmp))
        try:
            _wait_ready(port, process)
            yield server
        finally:
            server.stop()
