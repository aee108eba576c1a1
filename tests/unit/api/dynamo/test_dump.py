"""kvindex.api.dynamo.dump: the journal as Dynamo's stored events, a LoRA block's included with
Dynamo's LoRA-aware tokens hash (ai-dynamo-runtime 1.6.1 carries the adapter only there)."""

from __future__ import annotations

from typing import Any

import msgspec

from kvindex.api.dynamo.dump import dump
from kvindex.indexer.domain.events import BlockStored, StreamId, Tier
from kvindex.indexer.index.block_journal import BlockJournal, tokens_hash

TOKENS = list(range(1, 9))


def _stored(journal: BlockJournal) -> list[tuple[int, Any]]:
    """Each dumped event's worker and stored data, as a Dynamo peer reads them."""
    models = {"dynamo-5": "m", "dynamo-6": "m"}
    answer: Any = msgspec.json.decode(msgspec.json.encode(dump(journal, models.get, lambda _: 4)))
    events = answer["m:default"]["events"]
    return [(event["worker_id"], event["event"]["data"]["stored"]) for event in events]


def test_a_lora_store_is_dumped_with_its_lora_aware_tokens_hash() -> None:
    journal = BlockJournal()
    journal.observe(StreamId("dynamo-5"), BlockStored([7, 8], None, TOKENS, 4, Tier.GPU, "ad1"))
    journal.observe(StreamId("dynamo-6"), BlockStored([9], None, TOKENS[:4], 4, Tier.GPU))
    blocks = _stored(journal)
    assert blocks == [
        (5, {"parent_hash": None, "start_position": None, "blocks": [
            {"block_hash": 7, "tokens_hash": 4033386159037673140, "mm_extra_info": None}]}),
        (5, {"parent_hash": 7, "start_position": None, "blocks": [
            {"block_hash": 8, "tokens_hash": 689901486715976884, "mm_extra_info": None}]}),
        (6, {"parent_hash": None, "start_position": None, "blocks": [
            {"block_hash": 9, "tokens_hash": tokens_hash(TOKENS[:4]), "mm_extra_info": None}]}),
    ]  # fmt: skip
