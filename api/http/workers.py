"""Worker processes sharing one listening socket: the parent binds once, forks N workers (each
built after the fork; the parent runs no thread) and supervises them. SIGTERM or SIGINT goes
on to every worker, which drains; one still alive ``grace_s`` later is killed. A worker that
dies is forked again, unless it lived under :data:`MIN_UPTIME_S` (then all stop, exit 1).
A worker whose parent dies gets SIGTERM (Linux: ``PR_SET_PDEATHSIG``)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType

logger = logging.getLogger("kvindex.workers")
MIN_UPTIME_S = 5.0
"""A worker that dies sooner after its start is not forked again: the parent gives up."""
_PR_SET_PDEATHSIG = 1


def bound_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on ``host:port``, inherited by forked workers."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class Workers:
    """``num_workers`` processes each running ``serve(index)`` (index 0 to N-1), whose
    return ends that worker (its exit status 0; an exception: 1)."""

    def __init__(
        self,
        num_workers: int,
        serve: Callable[[int], None],
        listening: socket.socket,
        *,
        grace_s: float,
    ) -> None:
        self._num_workers = num_workers
        self._serve = serve
        self._listening = listening
        self._grace_s = grace_s
        self._pid_to_worker: dict[int, tuple[int, float]] = {}
        """A live worker's pid → (its index, its start in monotonic time)."""
        self._stopping = False
        self.exit_code = 0

    def run(self) -> int:
        """Fork the workers and supervise them until all have ended; the exit code."""
        previous = {s: signal.signal(s, self._stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for index in range(self._num_workers):
                self._fork(index)
            self._supervise()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self._listening.close()
        return self.exit_code

    def pids(self) -> list[int]:
        return list(self._pid_to_worker)

    def _fork(self, index: int) -> None:
        pid = os.fork()
        if pid == 0:
            os._exit(self._worker(index))
        self._pid_to_worker[pid] = (index, time.monotonic())
        logger.info("worker %d started (pid %d)", index, pid)

    def _worker(self, index: int) -> int:
        """In the child: its signals as a fresh process's, then ``serve``; the exit status."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        # Its own process group: a terminal's Ctrl-C reaches the parent alone, which passes
        # on one SIGTERM (uvicorn takes a second signal as "exit now", not "drain").
        os.setpgid(0, 0)
        _die_with_parent()
        try:
            self._serve(index)
        except BaseException:
            logger.exception("worker %d failed", index)
            return 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        return 0

    def _supervise(self) -> None:
        deadline: float | None = None
        while self._pid_to_worker:
            if self._stopping and deadline is None:
                deadline = time.monotonic() + self._grace_s
            if deadline is not None and time.monotonic() > deadline:
                self._signal_all(signal.SIGKILL)
            pid, status = os.waitpid(-1, os.WNOHANG if deadline is not None else 0)
            if pid == 0:
                time.sleep(0.05)  # draining: poll until the grace ends
                continue
            self._ended(pid, status)

    def _ended(self, pid: int, status: int) -> None:
        index, started = self._pid_to_worker.pop(pid, (-1, 0.0))
        if index < 0 or self._stopping:
            return
        lived_s = time.monotonic() - started
        code = os.waitstatus_to_exitcode(status)
        logger.error("worker %d (pid %d) ended (%d) after %.1f s", index, pid, code, lived_s)
        if lived_s < MIN_UPTIME_S:
            logger.error("worker %d died within %.0f s of its start: stopping", index, lived_s)
            self.exit_code = 1
            self._stop(signal.SIGTERM, None)
            return
        self._fork(index)

    def _stop(self, signum: int, _: FrameType | None) -> None:
        """Every worker is told to drain; no new connection waits on the parent's socket."""
        if not self._stopping:
            logger.info("stopping %d workers (signal %d)", len(self._pid_to_worker), signum)
        self._stopping = True
        self._listening.close()
        self._signal_all(signal.SIGTERM)

    def _signal_all(self, signum: int) -> None:
        for pid in self._pid_to_worker:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its parent dies (no orphan worker)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        logger.warning("cannot ask for SIGTERM on the parent's death")
        return
    if os.getppid() == 1:  # the parent died before the ask: nobody will tell
        os.kill(os.getpid(), signal.SIGTERM)
