"""A private ``redis-server`` on a free loopback port, for benchmarks.

The recipe is the tests' own (``tests/support/redis_server.py``): no persistence, bound to
127.0.0.1, stopped on exit, server defaults kept (so memory figures are a stock Redis's).
Benchmarks run as scripts (``python bench/ingest.py``), so the repository root is put on
the import path here to reach it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.redis_cluster import running_cluster
from tests.support.redis_server import free_port, running_redis

__all__ = ["free_port", "private_cluster", "private_redis"]


@contextmanager
def private_redis() -> Iterator[str]:
    """Start ``redis-server`` on a free loopback port; yields its URL; stops it on exit."""
    with running_redis() as server:
        yield server.url


@contextmanager
def private_cluster() -> Iterator[str]:
    """Start a 3-master Redis Cluster on loopback; yields one node's URL; stops it on exit."""
    with running_cluster() as nodes:
        yield nodes.url
