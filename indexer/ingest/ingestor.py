"""Domain events → index operations, applied in order per stream, from one thread. A store's
parent key comes from the batch, the stream's key cache or the index; one unknown everywhere
is an orphan, chained from a root off every real chain and counted, for a replay to repair."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias

import xxhash

from kvindex.indexer import native
from kvindex.indexer.domain.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    StreamId,
)
from kvindex.indexer.domain.health import NativeCounts, StreamReport
from kvindex.indexer.domain.keys import BlockKeyError, chain_keys, model_root, tokens_to_bytes
from kvindex.indexer.index.protocol import APPLIED, ApplyResult, BatchOps, BlockIndex, Op, OpKind

if TYPE_CHECKING:
    from kvindex.indexer.native._core import KeyCache, NativeBatch

AnyBatch: TypeAlias = "EventBatch | NativeBatch"


class NativeIngest(Protocol):
    native_ingest: bool

    def apply_native(
        self, stream: StreamId, batches: list[NativeBatch], cache: KeyCache, root: int
    ) -> NativeCounts: ...


MAIN_GROUP = 0
"""Only the main KV-cache group is indexed; other groups (hybrid models) are counted."""


def orphan_root(parent_hash: int) -> int:
    """Parent key for blocks whose parent is unknown: off every real chain."""
    return xxhash.xxh3_64_intdigest(b"kvindex/orphan\x00" + parent_hash.to_bytes(8, "big"))


@dataclass(slots=True)
class _Context:
    stream: StreamId
    model: str
    cache: KeyCache
    ops: list[Op]
    report: StreamReport


@dataclass(slots=True)
class _Pending:
    stream: StreamId
    batches: list[BatchOps]
    report: StreamReport


_STORE, _STORE_BY_HASH, _REMOVE, _CLEAR = (
    OpKind.STORE,
    OpKind.STORE_BY_HASH,
    OpKind.REMOVE,
    OpKind.CLEAR,
)


class Ingestor:
    def __init__(self, index: BlockIndex, *, cache_size: int = 1 << 16) -> None:
        self._index = index
        self._cache_size = cache_size
        self._caches: dict[StreamId, KeyCache] = {}
        self._roots: dict[str, int] = {}
        self._pending: _Pending | None = None
        native_index: NativeIngest = index  # type: ignore[assignment]  # checked next
        self._apply_native: Callable[..., NativeCounts] | None = (
            native_index.apply_native if getattr(index, "native_ingest", False) else None
        )
        # An index keeping a journal of events (JournaledIndex) is handed each one.
        self._observe: Callable[[StreamId, Event], None] | None = getattr(
            index, "observe_event", None
        )

    @property
    def native(self) -> bool:
        return self._apply_native is not None

    def forget(self, stream: StreamId) -> None:
        self._caches.pop(stream, None)

    def apply(self, stream: StreamId, model: str, batch: EventBatch) -> StreamReport:
        return self.apply_many(stream, model, [batch])

    def apply_many(
        self,
        stream: StreamId,
        model: str,
        batches: Sequence[AnyBatch],
        report: StreamReport | None = None,
    ) -> StreamReport:
        """Apply a stream's consecutive batches in order, in one index call (compiled when the
        index offers it); what was done is added to ``report`` (None: a new one), returned."""
        if report is None:
            report = StreamReport()
        self._pending = pending = _Pending(stream, [], report)
        native_kind = native.NativeBatch
        try:
            run: list[NativeBatch] = []
            for batch in batches:
                if type(batch) is native_kind:
                    run.append(batch)
                    continue
                if run:
                    self._native_run(stream, model, run, report)
                    run = []
                report.num_bad_events += batch.num_bad_events
                ops = self.translate(stream, model, batch, report)  # type: ignore[arg-type]
                pending.batches.append((batch.seq, batch.ts, ops))
            if run:
                self._native_run(stream, model, run, report)
            self._flush()
        finally:
            self._pending = None
        return report

    def _native_run(
        self, stream: StreamId, model: str, batches: list[NativeBatch], report: StreamReport
    ) -> None:
        if self._apply_native is None:
            raise TypeError("a NativeBatch reached an index without the compiled ingest path")
        self._flush()
        counts = self._apply_native(stream, batches, self._cache(stream), self._root(model))
        num_applied, unknown, unresolved, stored, removed, clears = counts[:6]
        other_group, misaligned, orphans, block_size = counts[6:]
        if num_applied:
            report.applied = True
        report.num_unknown_removals += unknown
        report.num_unresolved_stores += unresolved
        report.num_blocks_stored += stored
        report.num_blocks_removed += removed
        report.num_clears += clears
        report.num_skipped_group_events += other_group
        report.num_misaligned_events += misaligned
        report.num_orphan_stores += orphans
        if block_size >= 0:
            report.block_size = block_size

    def _cache(self, stream: StreamId) -> KeyCache:
        cache = self._caches.get(stream)
        if cache is None:
            cache = self._caches[stream] = native.KeyCache(self._cache_size)
        return cache

    def _root(self, model: str) -> int:
        root = self._roots.get(model)
        if root is None:
            root = self._roots[model] = model_root(model)
        return root

    def _flush(self) -> None:
        pending = self._pending
        if pending is None or not pending.batches:
            return
        results = self._index.apply_many(pending.stream, pending.batches)
        pending.batches = []
        report = pending.report
        for result in results:
            if result is APPLIED:
                report.applied = True
            else:
                _merge(report, result)

    def translate(
        self, stream: StreamId, model: str, batch: EventBatch, report: StreamReport
    ) -> list[Op]:
        cache = self._cache(stream)
        ops: list[Op] = []
        context = _Context(stream, model, cache, ops, report)
        for event in batch.events:
            if self._observe is not None:
                self._observe(stream, event)
            kind = type(event)
            if kind is BlockStored:
                self._store_ops(event, context)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                _remove_ops(event, ops, report)  # type: ignore[arg-type]
            elif kind is AllBlocksCleared:
                ops.append((_CLEAR, 0, 0, 0))  # type: ignore[arg-type]
                report.num_clears += 1
        cache.age()
        return ops

    def _store_ops(self, event: BlockStored, context: _Context) -> None:
        report, ops = context.report, context.ops
        hashes = event.block_hashes
        if event.group_idx is not None and event.group_idx != MAIN_GROUP:
            report.num_skipped_group_events += 1
            return
        block_size = event.block_size
        tokens = event.token_ids
        if block_size == 0 and not tokens:  # a tokenless CPU-offload store
            tier = event.tier
            ops.extend([(_STORE_BY_HASH, tier, h, 0) for h in hashes])
            report.num_blocks_stored += len(hashes)
            return
        extras = None
        if event.extra_keys is not None or event.lora_name is not None:
            extras = _extras(event, len(hashes))
        if (
            block_size <= 0
            or len(tokens) != len(hashes) * block_size
            or (extras is not None and len(extras) != len(hashes))
        ):
            report.num_misaligned_events += 1
            return
        try:
            # Tokens first: a store dropped for bad tokens must not count as an orphan too.
            if type(tokens) is native.PackedTokens:  # decoded packed: already the bytes
                token_bytes = tokens.packed
            else:
                token_bytes = tokens_to_bytes(tokens)
        except BlockKeyError:
            report.num_bad_events += 1
            return
        report.block_size = block_size
        parent = self._parent_key(event.parent_hash, context)
        tier = event.tier
        cache = context.cache
        if extras is None:  # compiled: keys, ops and the cache's mappings in one call
            num_blocks = native.store_chain(
                ops, cache, _STORE, tier, hashes, parent, token_bytes, block_size
            )
            report.num_blocks_stored += num_blocks
            return
        keys = chain_keys(parent, token_bytes, block_size, extras)
        put = cache.put
        for engine_hash, key in zip(hashes, keys, strict=True):
            ops.append((_STORE, tier, engine_hash, key))
            put(engine_hash, key)
        report.num_blocks_stored += len(keys)

    def _parent_key(self, parent_hash: int | None, context: _Context) -> int:
        if parent_hash is None:
            return self._root(context.model)
        key = context.cache.get(parent_hash)
        if key is not None:
            return key
        self._flush()  # the parent may be in a batch not yet sent to the index
        key = self._index.resolve(context.stream, [parent_hash])[0]
        if key is not None:
            context.cache.put(parent_hash, key)
            return key
        context.report.num_orphan_stores += 1
        return orphan_root(parent_hash)


def _remove_ops(event: BlockRemoved, ops: list[Op], report: StreamReport) -> None:
    if event.group_idx is not None and event.group_idx != MAIN_GROUP:
        report.num_skipped_group_events += 1
        return
    tier = event.tier
    hashes = event.block_hashes
    native.remove_ops(ops, _REMOVE, tier, hashes)
    report.num_blocks_removed += len(hashes)


def _extras(event: BlockStored, num_blocks: int) -> Sequence[object] | None:
    extra_keys = event.extra_keys
    if extra_keys is not None:
        if extra_keys.count(None) == len(extra_keys):
            return None
        return extra_keys
    if event.lora_name is not None:
        return [(event.lora_name,)] * num_blocks
    return None


def _merge(report: StreamReport, result: ApplyResult) -> None:
    report.applied = report.applied or result.applied
    report.num_unknown_removals += result.num_unknown_removals
    report.num_unresolved_stores += result.num_unresolved_stores
