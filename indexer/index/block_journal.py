"""``BlockJournal``: what each stream holds per tier as its engine said it (block hash, parent
hash, a hash of the block's tokens), for a replay of the index as stored events (Dynamo's
``/dump``); ``JournaledIndex`` keeps one beside an index. A LoRA block's tokens hash is Dynamo's
LoRA-aware one; blocks with other extra keys (a cache salt, multimodal hashes) and tokenless ones
are not kept."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import xxhash

from kvindex.indexer import native
from kvindex.indexer.domain.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    StreamId,
    Tier,
)
from kvindex.indexer.domain.keys import BlockKeyError, tokens_to_bytes
from kvindex.indexer.index.protocol import BlockIndex
from kvindex.indexer.index.wrapper import IndexWrapper

TOKENS_SEED = 1337
"""The seed of Dynamo's hash of a block's tokens (XXH3-64 over them as little-endian u32)."""
_SEED = TOKENS_SEED
_hash = xxhash.xxh3_64_intdigest
_LOW = (1 << 64) - 1


class Held(NamedTuple):
    """One block a stream holds: its engine hash, its parent's (None: a root), its tokens' hash."""

    block_hash: int
    parent_hash: int | None
    tokens_hash: int


def lora_seed(lora_name: str | None) -> int:
    """The seed of Dynamo's tokens hash of a block stored under ``lora_name``: ai-dynamo-runtime
    1.6.1's :data:`TOKENS_SEED` plus the name's XXH3-64 (kept to 64 bits); without a name, the
    plain seed."""
    if lora_name is None:
        return TOKENS_SEED
    return (TOKENS_SEED + _hash(lora_name.encode())) & _LOW


def tokens_hash(tokens: Sequence[int], lora_name: str | None = None) -> int:
    return _hash(tokens_to_bytes(tokens), lora_seed(lora_name))


def _seed_of(event: BlockStored) -> int | None:
    """The event's tokens-hash seed; None when Dynamo's hash of its blocks is not known: extra
    keys other than the LoRA name (as vLLM puts on each block of a LoRA request)."""
    extra, lora = event.extra_keys, event.lora_name
    if extra is None or extra.count(None) == len(extra):
        return lora_seed(lora)
    if lora is None or any(keys is not None and keys != (lora,) for keys in extra):
        return None
    return lora_seed(lora)


class BlockJournal:
    """Thread-safe; per (stream, tier) engine hash → parent and tokens hash, in arrival order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # engine hash → (parent hash + 1, 0 for none) << 64 | tokens hash
        self._held: dict[StreamId, dict[Tier, dict[int, int]]] = {}
        self._block_size: dict[StreamId, int] = {}

    def observe(self, stream: StreamId, event: Event) -> None:
        """Apply one event of the stream, in the stream's order."""
        kind = type(event)
        if kind is BlockStored:
            self._store(stream, event)  # type: ignore[arg-type]
        elif kind is BlockRemoved:
            self._remove(stream, event)  # type: ignore[arg-type]
        elif kind is AllBlocksCleared:
            self.clear(stream)

    def _store(self, stream: StreamId, event: BlockStored) -> None:
        size, tokens, hashes = event.block_size, event.token_ids, event.block_hashes
        seed = _SEED if event.lora_name is None and event.extra_keys is None else _seed_of(event)
        if seed is None or event.group_idx not in (None, 0):
            return
        if size <= 0 or len(tokens) != len(hashes) * size:
            return
        try:
            packed = (
                tokens.packed if type(tokens) is native.PackedTokens else tokens_to_bytes(tokens)
            )
        except BlockKeyError:
            return
        view, stride = memoryview(packed), size * 4
        hashed = [_hash(view[i : i + stride], seed) for i in range(0, len(packed), stride)]
        parent = 0 if event.parent_hash is None else event.parent_hash + 1
        with self._lock:
            held = self._held.setdefault(stream, {}).setdefault(event.tier, {})
            self._block_size[stream] = size
            for block_hash, tokens_hashed in zip(hashes, hashed, strict=True):
                held[block_hash] = parent << 64 | tokens_hashed  # one int: the least memory
                parent = block_hash + 1

    def _remove(self, stream: StreamId, event: BlockRemoved) -> None:
        with self._lock:
            held = self._held.get(stream, {}).get(event.tier)
            if held is not None:
                for block_hash in event.block_hashes:
                    held.pop(block_hash, None)

    def clear(self, stream: StreamId) -> None:
        with self._lock:
            self._held.pop(stream, None)

    def streams(self) -> list[StreamId]:
        with self._lock:
            return sorted(self._held)

    def block_size(self, stream: StreamId) -> int | None:
        with self._lock:
            return self._block_size.get(stream)

    def held(self, stream: StreamId) -> dict[Tier, list[Held]]:
        """Each tier's blocks, a parent before its children (a copy)."""
        with self._lock:
            tiers = {tier: dict(blocks) for tier, blocks in self._held.get(stream, {}).items()}
        return {tier: list(_parents_first(blocks)) for tier, blocks in tiers.items() if blocks}


def _parents_first(blocks: dict[int, int]) -> Iterator[Held]:
    done: set[int] = set()
    for first in blocks:
        chain = []
        block: int | None = first
        while block is not None and block in blocks and block not in done:
            chain.append(block)
            done.add(block)
            block = (blocks[block] >> 64) - 1 if blocks[block] >> 64 else None
        for block in reversed(chain):
            packed = blocks[block]
            parent = (packed >> 64) - 1 if packed >> 64 else None
            yield Held(block, parent, packed & _LOW)


class JournaledIndex(IndexWrapper):
    """A BlockIndex whose stores, removals and clears a :class:`BlockJournal` follows too; the
    ingestor hands it each event (:meth:`observe_event`), so the compiled ingest path is off."""

    native_ingest = False

    def __init__(self, inner: BlockIndex, journal: BlockJournal) -> None:
        super().__init__(inner)
        self.journal = journal
        self.observe_event = journal.observe

    def clear(self, stream: StreamId) -> None:
        self._inner.clear(stream)
        self.journal.clear(stream)

    def drop(self, stream: StreamId) -> None:
        self._inner.drop(stream)
        self.journal.clear(stream)
