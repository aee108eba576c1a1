"""Which ingest worker owns a stream (``ingest_workers``), and the workers' shared totals.

A stream belongs to one worker for the life of the process, so its batches are applied in
order by one pipeline and its state (tracker, key cache, replay) lives in one place. The
first worker to ask about a stream (each asks about every registered stream when it opens
sockets) gives it to the worker owning the fewest streams, the lowest on a tie: 16 replicas
split 8 and 8 on 2 workers, where a hash of the name can split them 11 and 5. A stream is
never moved or forgotten (a replica removed and added again keeps its worker): moving one
would need the two workers to hand its state over, and an entry costs about 200 bytes per
stream ever seen.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Protocol

from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.domain.health import UnroutedCounters


class StreamPartition:
    """The stream → worker map of ``num_workers`` workers. Thread-safe (one lock, taken
    when a worker asks, which it does while opening sockets, not per frame)."""

    def __init__(self, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self._worker_of: dict[StreamId, int] = {}
        self._num_streams = [0] * num_workers
        self._lock = threading.Lock()

    def worker_of(self, stream: StreamId) -> int:
        """The stream's worker, chosen now if it has none yet."""
        if self.num_workers == 1:
            return 0
        with self._lock:
            worker = self._worker_of.get(stream)
            if worker is None:
                counts = self._num_streams
                worker = counts.index(min(counts))
                self._worker_of[stream] = worker
                counts[worker] += 1
            return worker

    def num_streams(self) -> list[int]:
        """Streams given to each worker so far."""
        with self._lock:
            return list(self._num_streams)


class UnroutedSink(Protocol):
    """Where the fleet's unrouted totals go (``Registry.record_unrouted``)."""

    def record_unrouted(self, totals: UnroutedCounters) -> None: ...


class UnroutedTotals:
    """The unrouted-frame totals of every worker's pipeline, summed for the registry: each
    pipeline publishes its own running totals (:meth:`publisher`), and the registry gets
    their sum (it keeps one set of totals for the process). Thread-safe."""

    def __init__(self, registry: UnroutedSink, num_workers: int) -> None:
        self._registry = registry
        self._of = [UnroutedCounters() for _ in range(num_workers)]
        self._lock = threading.Lock()

    def publisher(self, worker: int) -> Callable[[UnroutedCounters], None]:
        """What worker ``worker``'s pipeline calls with its totals."""
        return lambda totals: self._record(worker, totals)

    def _record(self, worker: int, totals: UnroutedCounters) -> None:
        with self._lock:
            self._of[worker] = replace(totals)
            summed = UnroutedCounters()
            for name in (f.name for f in fields(UnroutedCounters)):
                setattr(summed, name, sum(getattr(c, name) for c in self._of))
            self._registry.record_unrouted(summed)
