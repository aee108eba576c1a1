"""A :class:`BlockJournal` as Dynamo's ``GET /dump``: ``{"<model>:default": {block_size,
events}}``, one stored event per block (its parent's first), numbered per instance and rank."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from kvindex.api.dynamo.instances import rank_of
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.index.block_journal import BlockJournal

TIER_NAMES = {Tier.GPU: "device", Tier.CPU: "host_pinned", Tier.OTHER: "disk"}


class DumpBlock(msgspec.Struct):
    block_hash: int
    tokens_hash: int
    mm_extra_info: None = None


class Stored(msgspec.Struct):
    parent_hash: int | None
    blocks: list[DumpBlock]
    start_position: None = None


class EventData(msgspec.Struct):
    stored: Stored


class CacheEvent(msgspec.Struct):
    event_id: int
    data: EventData
    dp_rank: int


class RouterEvent(msgspec.Struct):
    worker_id: int
    storage_tier: str
    event: CacheEvent
    residency_domain: str = "worker"


class ModelDump(msgspec.Struct):
    block_size: int
    events: list[RouterEvent]


def dump(
    journal: BlockJournal, model_of: Callable[[str], str | None], block_size: Callable[[str], int]
) -> dict[str, ModelDump]:
    """Every journalled stream of a registered replica (``model_of`` its replica's model)."""
    out: dict[str, ModelDump] = {}
    for stream in journal.streams():
        model = model_of(stream.replica)
        if model is None:
            continue
        key = f"{model}:default"
        entry = out.get(key)
        if entry is None:
            entry = out[key] = ModelDump(block_size(model), [])
        entry.events.extend(_events(journal, stream))
    return out


def _events(journal: BlockJournal, stream: StreamId) -> list[RouterEvent]:
    instance, rank = rank_of(stream)
    events: list[RouterEvent] = []
    for tier, blocks in sorted(journal.held(stream).items()):
        name = TIER_NAMES[tier]
        for held in blocks:
            stored = Stored(held.parent_hash, [DumpBlock(held.block_hash, held.tokens_hash)])
            event = CacheEvent(len(events), EventData(stored), rank)
            events.append(RouterEvent(instance, name, event))
    return events
