"""The process's limits on open files and ZeroMQ sockets, raised at start for a large fleet."""

from __future__ import annotations

import contextlib
import resource
from dataclasses import dataclass

import zmq

SOCKETS_PER_STREAM = 3
FILES_PER_STREAM = 4
FILES_PER_REPLAY = 2
ZMQ_DEFAULT_MAX_SOCKETS = 1023
NR_OPEN_FALLBACK = 1_048_576
"""The target when the hard limit is unlimited (Linux's default ``fs.nr_open``)."""

Context = zmq.Context[zmq.Socket[bytes]]


@dataclass(frozen=True, slots=True)
class FileLimit:
    """``RLIMIT_NOFILE`` (``hard``: how far the soft one may be raised)."""

    soft: int
    hard: int

    def __str__(self) -> str:
        hard = "unlimited" if self.hard == resource.RLIM_INFINITY else str(self.hard)
        return f"{self.soft} (hard {hard})"


def file_limit() -> FileLimit:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return FileLimit(soft, hard)


def raise_file_limit(wanted: int = 0) -> tuple[FileLimit, FileLimit]:
    """Soft open-file limit raised to ``wanted`` (0: hard limit), never lowered; (before, after)."""
    before = file_limit()
    ceiling = NR_OPEN_FALLBACK if before.hard == resource.RLIM_INFINITY else before.hard
    target = ceiling if wanted <= 0 else min(wanted, ceiling)
    if before.soft != resource.RLIM_INFINITY and target > before.soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, before.hard))
    return before, file_limit()


def sized_context(num_files: int) -> Context:
    """A ZeroMQ context whose socket limit is what ``num_files`` open files can hold."""
    context: Context = zmq.Context()
    ceiling = context.get(zmq.SOCKET_LIMIT)
    context.set(zmq.MAX_SOCKETS, max(ZMQ_DEFAULT_MAX_SOCKETS, min(num_files, ceiling)))
    return context


def files_needed(num_streams: int, num_replays: int = 0) -> int:
    return num_streams * FILES_PER_STREAM + num_replays * FILES_PER_REPLAY


def describe_limits(context: Context) -> str:
    return (
        f"open-file limit {file_limit()}, ZeroMQ sockets per context "
        f"{context.get(zmq.MAX_SOCKETS)}; each replica stream needs {SOCKETS_PER_STREAM} "
        f"sockets and about {FILES_PER_STREAM} open files ({FILES_PER_REPLAY} more while it "
        "replays): raise the hard open-file limit (`ulimit -Hn`, systemd LimitNOFILE=, "
        "docker --ulimit nofile=) and max_open_files, or run fewer replicas per indexer"
    )
