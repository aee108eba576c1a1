"""Membership: rendezvous assignment, leases over a fake Redis whose server clock is set by
hand, and the pipeline's side of the fence (a batch another indexer's claim refuses)."""

from __future__ import annotations

import logging
from typing import cast

import fakeredis
import pytest

from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.protocol import FencedError, IndexUnavailableError
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.ingest.membership import (
    Membership,
    Shard,
    member_of,
    rendezvous_owner,
)
from kvindex.indexer.ingest.pipeline import Pipeline
from kvindex.indexer.redis.schema import Schema
from tests.support.clock import Clock
from tests.unit.indexer.ingest.test_pipeline import MODEL, R1, frames

SCHEMA = Schema("test")
TTL = 9.0
STREAMS = [StreamId(f"r{i}", rank) for i in range(300) for rank in range(2)]


@pytest.fixture
def clock(server_clock: Clock) -> Clock:
    return server_clock


def owners(members: list[str]) -> dict[StreamId, str | None]:
    return {s: rendezvous_owner(str(s), members) for s in STREAMS}


# --- rendezvous ---------------------------------------------------------------------------


def test_no_member_owns_nothing_and_one_member_owns_everything() -> None:
    assert set(owners([]).values()) == {None}
    assert set(owners(["a"]).values()) == {"a"}


def test_the_owner_does_not_depend_on_the_order_members_are_listed() -> None:
    assert owners(["a", "b", "c"]) == owners(["c", "a", "b"])


def test_streams_split_about_evenly() -> None:
    counts = {m: 0 for m in ("a", "b", "c")}
    for owner in owners(["a", "b", "c"]).values():
        assert owner is not None
        counts[owner] += 1
    for count in counts.values():
        assert len(STREAMS) / 3 * 0.75 < count < len(STREAMS) / 3 * 1.25, counts


def test_a_member_leaving_moves_only_its_streams_and_a_join_takes_only_new_ones() -> None:
    before, after = owners(["a", "b", "c"]), owners(["a", "b"])
    moved = [s for s in STREAMS if before[s] != after[s]]
    assert moved and all(before[s] == "c" for s in moved)
    assert all(after[s] == before[s] for s in STREAMS if before[s] != "c")


def test_a_token_names_its_member() -> None:
    assert member_of("host-1:80#ab12cd34") == "host-1:80"


# --- leases -------------------------------------------------------------------------------


def members(client: fakeredis.FakeRedis, clock: Clock, *ids: str) -> list[Membership]:
    return [Membership(client, SCHEMA, i, lease_ttl_s=TTL, clock=clock) for i in ids]


def test_a_lapsed_lease_is_never_renewed_its_holder_joins_under_a_new_token(
    caplog: pytest.LogCaptureFixture, clock: Clock
) -> None:
    client = fakeredis.FakeRedis()
    a, b = members(client, clock, "a", "b")
    a.renew()
    b.renew()
    first = a.token
    clock.now += TTL + 1.0  # a paused past its lease; b renews first
    assert b.renew() == ("b",)
    assert a.renew() == ("a", "b")
    assert a.token != first and member_of(a.token) == "a"
    assert a.epoch == 2
    leases = {t.decode() for t in cast("list[bytes]", client.zrange(SCHEMA.indexers, 0, -1))}
    assert first not in leases and a.token in leases
    assert "ran out" in caplog.text


def test_members_see_each_other_and_split_every_stream_once(clock: Clock) -> None:
    client = fakeredis.FakeRedis()
    a, b = members(client, clock, "a", "b")
    a.renew()
    b.renew()
    a.renew()
    assert a.members == b.members == ("a", "b")
    for stream in STREAMS:
        assert a.owns(stream) != b.owns(stream)


def test_a_member_that_stops_renewing_drops_out_after_its_ttl(clock: Clock) -> None:
    client = fakeredis.FakeRedis()
    a, b = members(client, clock, "a", "b")
    a.renew()
    b.renew()
    clock.now += TTL - 0.5
    assert a.renew() == ("a", "b")  # b's lease still runs
    clock.now += 1.0
    assert a.renew() == ("a",)
    assert all(a.owns(s) for s in STREAMS)


def test_leave_removes_the_lease_at_once(clock: Clock) -> None:
    client = fakeredis.FakeRedis()
    a, b = members(client, clock, "a", "b")
    a.renew()
    b.renew()
    b.leave()
    assert a.renew() == ("a",)


def test_tick_renews_once_a_third_of_the_ttl(clock: Clock) -> None:
    client = fakeredis.FakeRedis()
    a, b = members(client, clock, "a", "b")
    assert a.tick()
    b.renew()
    clock.now += TTL / 3 - 0.1
    assert not a.tick()
    assert a.members == ("a",)  # not renewed: the view is the last one
    clock.now += 0.2
    assert a.tick()
    assert list(a.members) == ["a", "b"]


def test_tick_keeps_the_last_view_while_redis_is_down(
    caplog: pytest.LogCaptureFixture, clock: Clock
) -> None:
    server = fakeredis.FakeServer()
    a = Membership(fakeredis.FakeRedis(server=server), SCHEMA, "a", lease_ttl_s=TTL, clock=clock)
    assert a.tick()
    server.connected = False
    clock.now += TTL
    with pytest.raises(IndexUnavailableError):
        a.renew()
    assert not a.tick()
    assert a.members == ("a",)
    assert "lease not renewed" in caplog.text


def test_a_second_live_indexer_under_one_id_is_reported(
    caplog: pytest.LogCaptureFixture, clock: Clock
) -> None:
    client = fakeredis.FakeRedis()
    a, twin = members(client, clock, "a", "a")
    caplog.set_level(logging.ERROR)
    for _ in range(5):  # both keep renewing for longer than a ttl
        a.renew()
        twin.renew()
        clock.now += TTL / 3
    assert "give each indexer its own indexer_id" in caplog.text


def test_a_restarted_indexer_predecessor_is_not_reported(
    caplog: pytest.LogCaptureFixture, clock: Clock
) -> None:
    client = fakeredis.FakeRedis()
    dead, restarted = members(client, clock, "a", "a")
    dead.renew()
    caplog.set_level(logging.ERROR)
    for _ in range(5):
        restarted.renew()
        clock.now += TTL / 3
    assert "indexer_id" not in caplog.text


# --- the pipeline behind a fence ----------------------------------------------------------


def fenced_pipeline(
    client: fakeredis.FakeRedis, member: str, clock: Clock | None = None
) -> tuple[Pipeline, Shard]:
    clock = clock or Clock()
    membership = Membership(client, SCHEMA, member, lease_ttl_s=TTL, clock=clock)
    index = RedisIndex(client, SCHEMA)
    shard = Shard(membership, index)
    shard.tick()  # joins: the index is fenced with the lease's token
    spec = ReplicaSpec("r1", MODEL)
    config = IndexerSettings(replicas=(spec,))
    pipeline = Pipeline(config, index, Registry(config.replicas), claim=shard.claim)
    pipeline.track(R1, spec)
    return pipeline, shard


def test_a_batch_after_another_indexer_claimed_is_dropped_counted_and_handed_over() -> None:
    client = fakeredis.FakeRedis()
    old, _ = fenced_pipeline(client, "a")
    old.handle_frames([frames(0), frames(1)], R1)
    new, _ = fenced_pipeline(client, "b")  # claims r1, resumes from the stored mark
    reader = RedisIndex(client, SCHEMA)
    assert reader.stats(R1).watermark == 1
    old.handle_frames([frames(2)], R1)
    assert old.num_fenced_batches == 1
    assert old.take_fenced() == [R1]
    assert old.take_fenced() == []
    old.handle_frames([frames(3)], R1)  # nothing more is even tried for it
    assert old.num_fenced_batches == 1
    assert reader.stats(R1).watermark == 1
    new.handle_frames([frames(2), frames(3)], R1)
    assert reader.stats(R1).watermark == 3
    assert new.num_fenced_batches == 0


def test_a_claim_after_the_lease_ran_out_writes_nothing(clock: Clock) -> None:
    client = fakeredis.FakeRedis()
    pipeline, shard = fenced_pipeline(client, "a")
    pipeline.handle_frames([frames(0)], R1)
    other = StreamId("r2")
    clock.now += TTL + 1.0
    with pytest.raises(FencedError):
        shard.claim(other)
    assert client.hget(SCHEMA.stream_owners, str(other)) is None
    assert RedisIndex(client, SCHEMA).owner(other) is None


def test_a_rejoined_shard_fences_its_index_with_the_new_token(clock: Clock) -> None:
    client = fakeredis.FakeRedis()
    pipeline, shard = fenced_pipeline(client, "a", clock)
    pipeline.handle_frames([frames(0)], R1)
    clock.now += TTL + 1.0
    assert shard.tick()
    assert shard.take_rejoined() and not shard.take_rejoined()
    pipeline.release_all()
    assert pipeline.take_fenced() == []
    pipeline.track(R1, ReplicaSpec("r1", MODEL))  # claimed afresh under the new token
    assert RedisIndex(client, SCHEMA).owner(R1) == shard.token
    pipeline.handle_frames([frames(1)], R1)
    assert pipeline.num_fenced_batches == 0
    assert RedisIndex(client, SCHEMA).stats(R1).watermark == 1


def test_a_stream_opened_after_the_lease_ran_out_is_handed_back_unrecorded(clock: Clock) -> None:
    client = fakeredis.FakeRedis()
    spec = ReplicaSpec("r1", MODEL)
    membership = Membership(client, SCHEMA, "a", lease_ttl_s=TTL, clock=clock)
    shard = Shard(membership, RedisIndex(client, SCHEMA))
    shard.tick()
    registry = Registry((spec,))
    pipeline = Pipeline(
        IndexerSettings(replicas=(spec,)), RedisIndex(client, SCHEMA), registry, claim=shard.claim
    )
    clock.now += TTL + 1.0
    pipeline.track(R1, spec)
    assert pipeline.take_fenced() == [R1]
    assert registry.stream_ids() == []


def test_a_claim_taken_after_this_ones_is_found_without_a_batch_and_handed_over() -> None:
    """An owner whose view lagged a join claims after the joiner: the joiner's next renew
    finds the claim lost (no batch needed) and hands the stream over; the late one keeps it."""
    client = fakeredis.FakeRedis()
    joiner, joiner_shard = fenced_pipeline(client, "a")
    late, late_shard = fenced_pipeline(client, "b")  # claims r1 after the joiner did
    assert joiner_shard.lost_claims(joiner.claimed()) == [R1]
    assert late_shard.lost_claims(late.claimed()) == []
    joiner.hand_over(R1)
    assert joiner.take_fenced() == [R1] and joiner.claimed() == []
    assert joiner_shard.lost_claims([StreamId("r9")]) == []  # unclaimed: nobody's to lose


def test_lost_claims_are_none_while_redis_is_down() -> None:
    server = fakeredis.FakeServer()
    pipeline, shard = fenced_pipeline(fakeredis.FakeRedis(server=server), "a")
    server.connected = False
    assert shard.lost_claims(pipeline.claimed()) == []
