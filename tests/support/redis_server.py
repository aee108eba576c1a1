"""A real ``redis-server`` on a free loopback port, started and stopped by tests."""

from __future__ import annotations

import functools
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


PORTS_PER_RUN = 12000
"""Loopback ports the tests hand out lie in this many below the kernel's ephemeral range:
no port the kernel hands out (a bind to port 0, a connection's own port) is among them."""
_DEFAULT_EPHEMERAL_LOW = 32768
_cursor: list[int] = []  # the next port this process tries, once its share is known


@functools.cache
def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (what a bind to port 0 may get)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_LOW


def bindable(port: int) -> bool:
    """Whether a socket can bind ``port`` on loopback now (bound and released at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:  # something listens there, or a connection is closing on it
            return False
    return True


@functools.cache
def _share() -> range:
    # This process's ports: the run's, cut in as many shares as pytest-xdist runs workers
    # (one share when it runs none), so no two workers hand out the same port.
    low = ephemeral_low()
    first = max(1024, low - PORTS_PER_RUN)
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    size = (low - first) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return range(first + index * size, first + (index + 1) * size)


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports, taken in turn from this process's share
    (:func:`_share`), each bound and released to check it is free: a port is handed out
    again only after the whole share has been."""
    share = _share()
    if not _cursor:
        _cursor.append(share.start)
    chosen: list[int] = []
    for _ in range(len(share)):
        if len(chosen) == count:
            break
        port = _cursor[0]
        _cursor[0] = share.start if port + 1 >= share.stop else port + 1
        if bindable(port):
            chosen.append(port)
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
