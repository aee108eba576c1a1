"""A burst faster than ingest, over real ZeroMQ: the indexer's SUB queues a bounded number
of messages per publisher (the rest waits in TCP and in the publisher's queue), and nothing
is lost for it: every batch arrives, in order, with no gap."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvindex.indexer.domain.events import BlockStored, Event, StreamId, Tier
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import ApplyResult, BatchOps
from tests.integration.harness import (
    publisher_at,
    replica_of,
    running_indexer,
    settings_for,
    wait_until,
    warm_up,
)

R1 = StreamId("r1", 0)
NUM_BATCHES = 300
"""Far past the SUB's receive bound (8 messages)."""
BLOCKS_PER_BATCH = 32


class SlowIndex(MemoryIndex):
    """A memory index whose every write takes 2 ms more: ingest slower than the sender."""

    def apply_many(self, stream: StreamId, batches: Sequence[BatchOps]) -> list[ApplyResult]:
        time.sleep(0.002)
        return super().apply_many(stream, batches)


def _batch(i: int) -> list[Event]:
    """Batch ``i``: one chain of its own (hashes and tokens no other batch uses)."""
    first = i * BLOCKS_PER_BATCH
    hashes = tuple(range(first + 1, first + BLOCKS_PER_BATCH + 1))
    tokens = list(range(first * 16, (first + BLOCKS_PER_BATCH) * 16))
    return [BlockStored(hashes, None, tokens, 16, Tier.GPU)]


def test_a_burst_faster_than_ingest_arrives_whole_and_in_order() -> None:
    pub = publisher_at(None, None)
    index = SlowIndex()
    try:
        with running_indexer(settings_for(replica_of(pub)), index) as ix:
            warm_up(ix, pub, R1)
            gaps_before = ix.status(R1).health.num_gaps  # a slow joiner's, repaired by replay
            seq = -1
            for i in range(NUM_BATCHES):
                seq = pub.publish(_batch(i))
            wait_until(ix.applied(R1, seq), timeout_s=30, what="the burst applied")
            health = ix.status(R1).health
            assert health.num_gaps == gaps_before  # a lost frame is a gap, even once repaired
            assert index.stats(R1).num_blocks == NUM_BATCHES * BLOCKS_PER_BATCH
    finally:
        pub.close()
