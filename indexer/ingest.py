"""Domain events → index operations, applied one batch at a time per stream.

Block keys are computed here from token ids (``indexer.keys``), chained from the parent's
key. The parent's key comes from, in order: a block stored earlier in the same event or
batch, a per-stream cache of recent engine hash → key mappings, the index itself. A store
whose parent is unknown everywhere is an *orphan*: it is kept, chained from a root derived
from the parent's engine hash (so removals and its descendants still apply, but it can never
match a request by accident), counted, and reported so the subscriber can repair the stream
by replay.

Callers must apply a stream's batches in order from one thread; different streams may be
ingested concurrently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from indexer.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    StreamId,
)
from indexer.index import ApplyResult, BlockIndex, Op, OpKind
from indexer.keys import BlockKeyError, chain_keys, model_root, tokens_to_bytes

MAIN_GROUP = 0
"""Only the main KV-cache group is indexed; other groups (hybrid models) are counted."""


def orphan_root(parent_hash: int) -> int:
    """Parent key for blocks whose parent is unknown: off every real chain."""
    return xxhash.xxh3_64_intdigest(b"kvindex/orphan\x00" + parent_hash.to_bytes(8, "big"))


@dataclass(slots=True)
class IngestReport:
    """What one batch did; the subscriber adds these to the stream's counters."""

    applied: bool = False
    num_blocks_stored: int = 0
    num_blocks_removed: int = 0
    num_clears: int = 0
    num_orphan_stores: int = 0
    num_misaligned_events: int = 0
    num_skipped_group_events: int = 0
    num_bad_events: int = 0
    num_unknown_removals: int = 0
    num_unresolved_stores: int = 0


@dataclass(slots=True)
class _KeyCache:
    """Recent engine hash → key mappings of one stream, oldest evicted first."""

    capacity: int
    hash_to_key: dict[int, int] = field(default_factory=dict)

    def put(self, engine_hash: int, key: int) -> None:
        mapping = self.hash_to_key
        if engine_hash not in mapping and len(mapping) >= self.capacity:
            del mapping[next(iter(mapping))]
        mapping[engine_hash] = key


class Ingestor:
    """Translates and applies batches for any number of streams over one index."""

    def __init__(self, index: BlockIndex, *, cache_size: int = 1 << 16) -> None:
        self._index = index
        self._cache_size = cache_size
        self._caches: dict[StreamId, _KeyCache] = {}
        self._roots: dict[str, int] = {}

    def forget(self, stream: StreamId) -> None:
        """Drop cached mappings of a stream (after its engine restarted or it was dropped)."""
        self._caches.pop(stream, None)

    def apply(self, stream: StreamId, model: str, batch: EventBatch) -> IngestReport:
        """Translate one batch and apply it atomically (a no-op at or below the watermark)."""
        report = IngestReport(num_bad_events=batch.num_bad_events)
        ops = self.translate(stream, model, batch, report)
        result = self._index.apply(stream, batch.seq, batch.ts, ops)
        _merge(report, result)
        return report

    def translate(
        self, stream: StreamId, model: str, batch: EventBatch, report: IngestReport
    ) -> list[Op]:
        cache = self._caches.get(stream)
        if cache is None:
            cache = self._caches[stream] = _KeyCache(self._cache_size)
        ops: list[Op] = []
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store_ops(stream, model, event, cache=cache, ops=ops, report=report)
            elif isinstance(event, BlockRemoved):
                self._remove_ops(event, ops, report)
            elif isinstance(event, AllBlocksCleared):
                ops.append((OpKind.CLEAR, 0, 0, 0))  # type: ignore[arg-type]
                report.num_clears += 1
        return ops

    def _remove_ops(self, event: BlockRemoved, ops: list[Op], report: IngestReport) -> None:
        if event.group_idx not in (None, MAIN_GROUP):
            report.num_skipped_group_events += 1
            return
        tier = event.tier
        ops.extend((OpKind.REMOVE, tier, h, 0) for h in event.block_hashes)
        report.num_blocks_removed += len(event.block_hashes)

    def _store_ops(
        self,
        stream: StreamId,
        model: str,
        event: BlockStored,
        *,
        cache: _KeyCache,
        ops: list[Op],
        report: IngestReport,
    ) -> None:
        if event.group_idx not in (None, MAIN_GROUP):
            report.num_skipped_group_events += 1
            return
        if event.is_placeholder:
            ops.extend((OpKind.STORE_BY_HASH, event.tier, h, 0) for h in event.block_hashes)
            report.num_blocks_stored += len(event.block_hashes)
            return
        keys = self._event_keys(stream, model, event, cache, report)
        if keys is None:
            return
        tier = event.tier
        for engine_hash, key in zip(event.block_hashes, keys, strict=True):
            ops.append((OpKind.STORE, tier, engine_hash, key))
            cache.put(engine_hash, key)
        report.num_blocks_stored += len(keys)

    def _event_keys(
        self,
        stream: StreamId,
        model: str,
        event: BlockStored,
        cache: _KeyCache,
        report: IngestReport,
    ) -> list[int] | None:
        """Keys of an event's blocks, or None (counted) when its tokens do not line up."""
        num_blocks = len(event.block_hashes)
        extras = _extras(event, num_blocks)
        aligned = event.block_size > 0 and len(event.token_ids) == num_blocks * event.block_size
        if not aligned or (extras is not None and len(extras) != num_blocks):
            report.num_misaligned_events += 1
            return None
        try:
            # Tokens first: a store dropped for bad tokens must not count as an orphan too.
            token_bytes = tokens_to_bytes(event.token_ids)
            parent = self._parent_key(stream, model, event.parent_hash, cache, report)
            return chain_keys(parent, token_bytes, event.block_size, extras)
        except BlockKeyError:
            report.num_bad_events += 1
            return None

    def _parent_key(
        self,
        stream: StreamId,
        model: str,
        parent_hash: int | None,
        cache: _KeyCache,
        report: IngestReport,
    ) -> int:
        if parent_hash is None:
            root = self._roots.get(model)
            if root is None:
                root = self._roots[model] = model_root(model)
            return root
        key = cache.hash_to_key.get(parent_hash)
        if key is not None:
            return key
        key = self._index.resolve(stream, [parent_hash])[0]
        if key is not None:
            cache.put(parent_hash, key)
            return key
        report.num_orphan_stores += 1
        return orphan_root(parent_hash)


def _extras(event: BlockStored, num_blocks: int) -> Sequence[object] | None:
    """Per-block extra keys: as published (vLLM 0.17+), else the LoRA name on every block."""
    if event.extra_keys is not None:
        if all(e is None for e in event.extra_keys):
            return None
        return event.extra_keys
    if event.lora_name is not None:
        return [(event.lora_name,)] * num_blocks
    return None


def _merge(report: IngestReport, result: ApplyResult) -> None:
    report.applied = result.applied
    report.num_unknown_removals = result.num_unknown_removals
    report.num_unresolved_stores = result.num_unresolved_stores
