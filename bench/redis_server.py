"""A private ``redis-server`` on a free loopback port, for benchmarks.

The same recipe as ``tests/support/redis_server.py`` (which a script under ``bench/`` cannot
import): no persistence, bound to 127.0.0.1, stopped on exit. Server defaults are kept
(listpack thresholds, jemalloc), so memory figures are what a stock Redis gives.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


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
def private_redis() -> Iterator[str]:
    """Start ``redis-server`` on a free loopback port; yields its URL; stops it on exit."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (or pass --redis-url)")
    with tempfile.TemporaryDirectory(prefix="kvindex-bench-redis-") as workdir:
        port = free_port()
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", workdir, "--protected-mode", "yes"]
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_ready(port, process)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
