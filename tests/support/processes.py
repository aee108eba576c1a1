"""Real processes for black-box fault tests: a redis-server, ``kvindex`` commands, and the
signals a fault sends them (SIGKILL, SIGSTOP / SIGCONT).

A :class:`Child` is one command on fixed loopback ports, so it can be killed and started
again at the same address; its output goes to a log file that a failing test can show.
:meth:`Child.stop` always ends the process (SIGCONT first, so a stopped one can take its
SIGTERM; SIGKILL after a grace), and a :class:`contextlib.ExitStack` of ``stop`` calls is
how a fixture makes sure every process it started is gone, whatever the test did.
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

KVINDEX = Path(os.environ.get("KVINDEX_UNDER_TEST") or Path(sys.executable).parent / "kvindex")
"""The ``kvindex`` command black-box tests start: the test interpreter's, or the one
``KVINDEX_UNDER_TEST`` names (to run a regression test against an older build)."""


@contextmanager
def running(
    log: Path, *args: str, env: Mapping[str, str] | None = None, stdout: bool = True
) -> Iterator[subprocess.Popen[bytes]]:
    """``kvindex *args``, its stderr (and stdout, unless ``stdout`` is False) written to
    ``log``; on exit terminated, and killed if it has not ended 10 s later."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(KVINDEX), *args],
            stdout=out if stdout else subprocess.DEVNULL,
            stderr=out,
            env=None if env is None else dict(env),
        )
        try:
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class ChildError(RuntimeError):
    """A child process that exited or never became ready; carries the tail of its log."""


@dataclass
class Child:
    """One command run as a subprocess; ``ready`` says when it serves (polled by start)."""

    name: str
    args: list[str]
    log: Path
    ready: Callable[[], bool] = field(default=lambda: True)
    process: subprocess.Popen[bytes] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables set for the command, over the test process's own environment."""

    def spawn(self) -> None:
        """Start the command (not waiting for it to be ready); a running one is an error."""
        assert not self.running, f"{self.name} is already running"
        with self.log.open("ab") as out:
            env = {**os.environ, **self.env} if self.env else None
            self.process = subprocess.Popen(
                self.args, stdout=out, stderr=subprocess.STDOUT, env=env
            )

    def wait_ready(self, timeout_s: float = 15.0) -> None:
        """Return once ``ready()`` holds; raises :class:`ChildError` if the process exits or
        the timeout passes first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.running:
                raise ChildError(f"{self.name} exited: {self.tail()}")
            if self.ready():
                return
            time.sleep(0.02)
        raise ChildError(f"{self.name} not ready after {timeout_s} s: {self.tail()}")

    def start(self, timeout_s: float = 15.0) -> None:
        self.spawn()
        self.wait_ready(timeout_s)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, signum: signal.Signals) -> None:
        assert self.process is not None and self.running, f"{self.name} is not running"
        self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL and reap: the process gets no chance to clean up (kill -9)."""
        self.signal(signal.SIGKILL)
        assert self.process is not None
        self.process.wait(5)

    def terminate(self) -> None:
        """Ask the process to end (SIGCONT first: a stopped one takes its SIGTERM then);
        does not wait (see :meth:`stop`)."""
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.terminate()

    def stop(self) -> None:
        """End the process if it runs (stopped or not): SIGTERM, SIGKILL after 5 s."""
        self.terminate()
        process = self.process
        if process is None:
            return
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)

    def tail(self, num_chars: int = 2000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text[-num_chars:]


def redis_child(port: int, workdir: Path, *, aof: bool) -> Child:
    """A redis-server on ``127.0.0.1:port`` keeping its files in ``workdir``; ``aof``: an
    append-only file fsynced at every write (a kill -9 loses no acknowledged write)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ChildError("redis-server is not installed (CI installs it: .ci/run)")
    persistence = (
        ["--appendonly", "yes", "--appendfsync", "always"] if aof else ["--appendonly", "no"]
    )
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(workdir)]
    return Child(f"redis:{port}", [*args, *persistence], workdir / "redis.log", _pings(port))


def _pings(port: int) -> Callable[[], bool]:
    def ready() -> bool:
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.2)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    return ready


def http_ok(
    port: int, path: str, method: str = "GET", body: bytes | None = None
) -> Callable[[], bool]:
    """A readiness check: ``method http://127.0.0.1:port/path`` (a JSON ``body`` if given)
    answers 200 within 0.5 s (plain ``http.client``: an httpx client per poll costs a TLS
    context each time)."""
    headers = {} if body is None else {"content-type": "application/json"}

    def ready() -> bool:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=0.5)
        try:
            connection.request(method, path, body, headers)
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()

    return ready


def kvindex_child(name: str, args: list[str], log: Path, ready: Callable[[], bool]) -> Child:
    """``kvindex <args>`` as a child."""
    return Child(name, [str(KVINDEX), *args], log, ready)
