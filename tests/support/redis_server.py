"""A real ``redis-server`` on a free loopback port, started and stopped by tests."""

from __future__ import annotations

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


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports: each held until all are chosen (ports taken
    one at a time can come back the same, the kernel handing out a port just released)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


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
