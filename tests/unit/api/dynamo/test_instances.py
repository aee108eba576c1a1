"""Instance ids ↔ replica ids."""

from __future__ import annotations

from kvindex.api.dynamo.instances import Rank, instance_of_name, rank_of, registered, replica_id
from kvindex.indexer.domain.events import StreamId


def test_registered_ranks_round_trip() -> None:
    for instance, rank in ((0, 0), (7, 0), (7, 3), (2**64 - 1, 1023)):
        assert registered(replica_id(instance, rank)) == Rank(instance, rank)
        assert rank_of(StreamId(replica_id(instance, rank))) == Rank(instance, rank)


def test_other_replicas_get_a_stable_53_bit_id() -> None:
    for name in ("r1", "dynamo-01", "dynamo-7.dp0", f"dynamo-{2**64}", "dynamo-x"):
        assert registered(name) is None
        assert instance_of_name(name) == instance_of_name(name) < 2**53
    assert rank_of(StreamId("r1", 2)) == Rank(instance_of_name("r1"), 2)
    assert instance_of_name("r1") != instance_of_name("r2")
