"""The store circuit: skip a store that is down instead of waiting on it at every call;
:class:`CircuitIndex` puts one around a :class:`~kvindex.indexer.index.protocol.BlockIndex`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.index.protocol import (
    ApplyResult,
    BatchOps,
    BlockIndex,
    HeldRuns,
    IndexUnavailableError,
    Op,
    PrefixMatch,
    StreamStats,
)
from kvindex.indexer.index.wrapper import IndexWrapper

T = TypeVar("T")
log = logging.getLogger("kvindex.store")


class StoreSkippedError(IndexUnavailableError):
    """A call not made: the store failed less than the circuit's cool-down ago."""


class StoreCircuit:
    """Closed, every call goes through. An :class:`IndexUnavailableError` opens it: for
    ``cooldown_s`` every call raises :class:`StoreSkippedError` at once; then one call goes
    through as a probe, whose success closes it. Thread-safe; logs each change once."""

    def __init__(
        self, cooldown_s: float, *, name: str = "redis", clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._cooldown_s = cooldown_s
        self._name = name
        self._clock = clock
        self._lock = threading.Lock()
        self._retry_at: float | None = None

        self._last_error = ""
        self.num_openings = 0
        self.num_skipped = 0

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._retry_at is not None

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, unless the circuit refuses it (raises :class:`StoreSkippedError`)."""
        self._admit(probe=True)
        return self._guarded(fn, *args)

    def call_if_closed(self, fn: Callable[..., T], *args: Any) -> T:
        """Like :meth:`call`, but never as the probe (for callers that must not wait)."""
        self._admit(probe=False)
        return self._guarded(fn, *args)

    def _admit(self, *, probe: bool) -> None:
        with self._lock:
            if self._retry_at is None:
                return
            now = self._clock()
            if probe and now >= self._retry_at:
                self._retry_at = now + self._cooldown_s  # this call probes; others wait
                return
            self.num_skipped += 1
            error = self._last_error
        raise StoreSkippedError(f"{self._name} skipped (down, next probe soon): {error}")

    def _guarded(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            result = fn(*args)
        except IndexUnavailableError as exc:
            self._failed(exc)
            raise
        self._succeeded()
        return result

    def _failed(self, exc: IndexUnavailableError) -> None:
        with self._lock:
            opened = self._retry_at is None
            self._retry_at = self._clock() + self._cooldown_s
            self._last_error = str(exc)
            if opened:
                self.num_openings += 1
        if opened:
            log.warning("%s unreachable; skipping it between probes: %s", self._name, exc)

    def _succeeded(self) -> None:
        with self._lock:
            closed = self._retry_at is not None
            self._retry_at = None
        if closed:
            log.warning("%s reachable again", self._name)


class CircuitIndex(IndexWrapper):
    """A :class:`BlockIndex` whose every call goes through a :class:`StoreCircuit` (but
    :meth:`close`, which releases connections whatever the store's state)."""

    def __init__(self, inner: BlockIndex, circuit: StoreCircuit) -> None:
        super().__init__(inner)
        self._circuit = circuit

    def apply(self, stream: StreamId, seq: int, ts: float, ops: Sequence[Op]) -> ApplyResult:
        return self._circuit.call(self._inner.apply, stream, seq, ts, ops)

    def apply_many(self, stream: StreamId, batches: Sequence[BatchOps]) -> list[ApplyResult]:
        return self._circuit.call(self._inner.apply_many, stream, batches)

    def resolve(self, stream: StreamId, engine_hashes: Sequence[int]) -> list[int | None]:
        return self._circuit.call(self._inner.resolve, stream, engine_hashes)

    def clear(self, stream: StreamId) -> None:
        self._circuit.call(self._inner.clear, stream)

    def drop(self, stream: StreamId) -> None:
        self._circuit.call(self._inner.drop, stream)

    def streams(self) -> list[StreamId]:
        return self._circuit.call(self._inner.streams)

    def longest_prefix(
        self, keys: Sequence[int], streams: Iterable[StreamId]
    ) -> dict[StreamId, PrefixMatch]:
        return self._circuit.call(self._inner.longest_prefix, keys, streams)

    def holders(self, keys: Sequence[int], streams: Sequence[StreamId]) -> HeldRuns:
        return self._circuit.call(self._holders, keys, streams)

    def stats(self, stream: StreamId) -> StreamStats:
        return self._circuit.call(self._inner.stats, stream)

    def intact(self) -> bool:
        return self._circuit.call(super().intact)
