"""The process's limits on open files and ZeroMQ sockets, raised at start for a large fleet.

A connect-mode stream holds :data:`SOCKETS_PER_STREAM` ZeroMQ sockets (its SUB and the two
PAIR ends of its socket monitor: vLLM's topic is empty, so one SUB per stream is what names
the stream) and about :data:`FILES_PER_STREAM` file descriptors (a wake-up descriptor per
socket and the TCP connection); a replay adds a DEALER (:data:`FILES_PER_REPLAY`) while it
runs. Two limits stop a fleet of hundreds: libzmq's 1,023 sockets per context (lifted by
:func:`sized_context`) and the soft ``RLIMIT_NOFILE`` (raised towards the hard limit by
:func:`raise_file_limit`). What is still out of reach is named by :func:`describe_limits`.
"""

from __future__ import annotations

import contextlib
import resource
from dataclasses import dataclass

import zmq

SOCKETS_PER_STREAM = 3
FILES_PER_STREAM = 4
FILES_PER_REPLAY = 2
ZMQ_DEFAULT_MAX_SOCKETS = 1023
"""libzmq's default ``ZMQ_MAX_SOCKETS``."""
NR_OPEN_FALLBACK = 1_048_576
"""The target when the hard limit is unlimited (Linux refuses more than ``fs.nr_open``,
whose default this is)."""

Context = zmq.Context[zmq.Socket[bytes]]


@dataclass(frozen=True, slots=True)
class FileLimit:
    """``RLIMIT_NOFILE``: ``soft`` is enforced, ``hard`` is how far a process may raise it
    (``resource.RLIM_INFINITY``: unlimited)."""

    soft: int
    hard: int

    def __str__(self) -> str:
        hard = "unlimited" if self.hard == resource.RLIM_INFINITY else str(self.hard)
        return f"{self.soft} (hard {hard})"


def file_limit() -> FileLimit:
    """The process's open-file limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return FileLimit(soft, hard)


def raise_file_limit(wanted: int = 0) -> tuple[FileLimit, FileLimit]:
    """Raise the soft open-file limit to ``wanted`` (0: to the hard limit), never above the
    hard limit and never lowering it. Returns the limit (before, after); a refused raise
    (a kernel cap below the hard limit) leaves it as it was."""
    before = file_limit()
    ceiling = NR_OPEN_FALLBACK if before.hard == resource.RLIM_INFINITY else before.hard
    target = ceiling if wanted <= 0 else min(wanted, ceiling)
    if before.soft != resource.RLIM_INFINITY and target > before.soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, before.hard))
    return before, file_limit()


def sized_context(num_files: int) -> Context:
    """A new ZeroMQ context whose socket limit (``ZMQ_MAX_SOCKETS``, fixed once the first
    socket opens) is what ``num_files`` open files can hold: every socket needs a file, so
    the open-file limit stays the only one to reach. At least libzmq's default, at most its
    ceiling (``ZMQ_SOCKET_LIMIT``)."""
    context: Context = zmq.Context()
    ceiling = context.get(zmq.SOCKET_LIMIT)
    context.set(zmq.MAX_SOCKETS, max(ZMQ_DEFAULT_MAX_SOCKETS, min(num_files, ceiling)))
    return context


def files_needed(num_streams: int, num_replays: int = 0) -> int:
    """About how many files ``num_streams`` connect-mode streams hold, with ``num_replays``
    replays running."""
    return num_streams * FILES_PER_STREAM + num_replays * FILES_PER_REPLAY


def describe_limits(context: Context) -> str:
    """The limits a socket that failed to open ran into, and how to lift them (one line)."""
    return (
        f"open-file limit {file_limit()}, ZeroMQ sockets per context "
        f"{context.get(zmq.MAX_SOCKETS)}; each replica stream needs {SOCKETS_PER_STREAM} "
        f"sockets and about {FILES_PER_STREAM} open files ({FILES_PER_REPLAY} more while it "
        "replays): raise the hard open-file limit (`ulimit -Hn`, systemd LimitNOFILE=, "
        "docker --ulimit nofile=) and max_open_files, or run fewer replicas per indexer"
    )
