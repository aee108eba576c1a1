"""Streams whose block size is not their model's: they can never match a request's keys."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from kvindex.api.config.settings import ApiSettings
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.fleet.registry import RegistryView, StreamStatus
from kvindex.indexer.fleet.replica import ReplicaSpec

logger = logging.getLogger("kvindex.api.health.block_sizes")


@dataclass(frozen=True, slots=True)
class BlockSizeMismatch:
    stream: StreamId
    model: str
    block_size: int
    expected: int


class BlockSizeCheck:
    """Compares every stream's block size with its model's; thread-safe; warns once each."""

    def __init__(self, settings: ApiSettings, registry: RegistryView) -> None:
        self._settings = settings
        self._registry = registry
        self._lock = threading.Lock()
        self._warned: set[tuple[StreamId, int, int]] = set()

    def models(self) -> list[str]:
        configured = {m.name for m in self._settings.models}
        return sorted(configured | set(self._registry.models()))

    def expected(self, model: str) -> int | None:
        """The model's block size: configured, else the fleet's most common (None: unseen)."""
        spec = self._settings.model(model)
        if spec is not None and spec.block_size:
            return spec.block_size
        return self._registry.block_size(model)

    def mismatches(
        self,
        statuses: Iterable[StreamStatus] | None = None,
        specs: Iterable[ReplicaSpec] | None = None,
    ) -> dict[StreamId, BlockSizeMismatch]:
        """Every stream whose published size differs from its model's."""
        replica_to_model = {
            s.id: s.model for s in (specs if specs is not None else self._registry.replicas())
        }
        model_to_expected: dict[str, int | None] = {}
        found: dict[StreamId, BlockSizeMismatch] = {}
        for status in statuses if statuses is not None else self._registry.statuses():
            size = status.health.block_size
            model = replica_to_model.get(status.stream.replica)
            if not size or model is None:
                continue
            if model not in model_to_expected:
                model_to_expected[model] = self.expected(model)
            expected = model_to_expected[model]
            if expected is not None and size != expected:
                found[status.stream] = BlockSizeMismatch(status.stream, model, size, expected)
        self._warn(found.values())
        return found

    def _warn(self, mismatches: Iterable[BlockSizeMismatch]) -> None:
        with self._lock:
            new = [
                m for m in mismatches if (m.stream, m.block_size, m.expected) not in self._warned
            ]
            self._warned.update((m.stream, m.block_size, m.expected) for m in new)
        for m in new:
            logger.warning(
                "stream %s publishes block size %d but model %s uses %d: it can never match",
                m.stream,
                m.block_size,
                m.model,
                m.expected,
                extra={"stream": str(m.stream), "model": m.model, "block_size": m.block_size},
            )


def _seen_as(mismatch: BlockSizeMismatch) -> tuple[StreamId, int, int]:
    return mismatch.stream, mismatch.block_size, mismatch.expected
