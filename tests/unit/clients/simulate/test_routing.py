from __future__ import annotations

import asyncio

import pytest

from kvindex.clients.fake_vllm.block_pool import BlockPool
from kvindex.clients.fake_vllm.engine_hash import engine_chain, engine_root
from kvindex.clients.simulate.fleet import (
    FleetSettings,
    Job,
    ReplicaLoad,
    SimulationError,
)
from kvindex.clients.simulate.routing import (
    IngestSink,
    InstantRouter,
    PolicySpec,
    ScorerRouter,
    SimClock,
    parse_policy,
)
from kvindex.clients.workloads.trace import TraceRequest
from kvindex.indexer.domain.events import BlockStored, Event, StreamId, Tier
from kvindex.indexer.domain.keys import block_keys

FLEET = FleetSettings(replicas=3, capacity_blocks=64, block_size=4)
ROOT = engine_root(FLEET.model)
PROMPT = list(range(1, 17))  # 4 blocks


def job(prompt: list[int], session: str | None = None) -> Job:
    request = TraceRequest(0.0, len(prompt), 1, session, prompt)
    return Job(0, request, prompt, engine_chain(ROOT, prompt, FLEET.block_size))


def idle() -> list[ReplicaLoad]:
    return [ReplicaLoad(r, 0, 0, 0.0) for r in FLEET.replica_ids()]


def stored(prompt: list[int]) -> list[Event]:
    """What a replica emits when it caches ``prompt``'s full blocks."""
    cache = BlockPool(64, FLEET.block_size, ROOT)
    admission = cache.admit(0, prompt, len(prompt), chain=engine_chain(ROOT, prompt, 4))
    assert admission is not None
    return admission.events


def test_policy_specs_parse_with_weight_overrides() -> None:
    assert parse_policy("kv_aware") == PolicySpec("kv_aware", "kv_aware")
    spec = parse_policy(" kv_aware:waiting=0.5, cache=2 ")
    assert (spec.label, spec.policy, spec.weights) == (
        "kv_aware:waiting=0.5, cache=2",
        "kv_aware",
        {"waiting": 0.5, "cache": 2.0},
    )
    assert parse_policy("kv_aware_instant").policy == "kv_aware_instant"
    with pytest.raises(SimulationError, match="'kv_aware_instant'"):
        parse_policy("oracle")  # the bound every report ends with, not a policy


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("best", "not one of"),
        ("kv_aware:waiting", "weight=number"),
        ("kv_aware:waiting=x", "weight=number"),
        ("kv_aware:nope=1", "unknown weights"),
        ("kv_aware:waiting=-1", "finite and >= 0"),
    ],
)
def test_bad_policy_specs_are_named(text: str, message: str) -> None:
    with pytest.raises(SimulationError, match=message):
        parse_policy(text)


def test_the_sink_applies_events_only_after_the_event_delay() -> None:
    clock = SimClock()
    sink = IngestSink(FLEET, clock, event_delay_s=0.5, stale_after_s=300.0)
    sink.emitted("r1", stored(PROMPT), 1.0)
    keys = block_keys(FLEET.model, PROMPT, FLEET.block_size)
    sink.deliver(1.4)
    assert sink.index.longest_prefix(keys, [StreamId("r1")])[StreamId("r1")].num_blocks == 0
    clock.now = 1.5
    sink.deliver(1.5)
    match = sink.index.longest_prefix(keys, [StreamId("r1")])[StreamId("r1")]
    assert (match.num_blocks, set(match.tiers)) == (4, {Tier.GPU})
    status = sink.registry.status(StreamId("r1"))
    assert status is not None
    assert (status.health.last_seq, status.health.lag_s) == (0, 0.5)


def test_kv_aware_through_the_real_scorer_follows_the_cache() -> None:
    clock = SimClock()
    sink = IngestSink(FLEET, clock, event_delay_s=0.0, stale_after_s=300.0)
    router = ScorerRouter(parse_policy("kv_aware"), FLEET, sink=sink, clock=clock, seed=0)
    router.emitted("r2", stored(PROMPT), 0.0)
    assert asyncio.run(router.route(job([*PROMPT, 99]), 1.0, idle())) == "r2"


def test_kv_aware_does_not_see_events_still_in_flight() -> None:
    clock = SimClock()
    sink = IngestSink(FLEET, clock, event_delay_s=5.0, stale_after_s=300.0)
    router = ScorerRouter(parse_policy("kv_aware"), FLEET, sink=sink, clock=clock, seed=0)
    router.emitted("r2", stored(PROMPT), 0.0)
    loads = [
        ReplicaLoad("r0", 0, 0, 0.0),
        ReplicaLoad("r1", 3, 2, 0.5),
        ReplicaLoad("r2", 3, 2, 0.5),
    ]
    assert asyncio.run(router.route(job(PROMPT), 1.0, loads)) == "r0"  # load decides
    assert asyncio.run(router.route(job(PROMPT), 6.0, loads)) == "r2"  # now it is indexed


def test_the_load_policies_read_the_pushed_load() -> None:
    clock = SimClock()
    router = ScorerRouter(parse_policy("least_load"), FLEET, sink=None, clock=clock, seed=0)
    loads = [
        ReplicaLoad("r0", 5, 1, 0.5),
        ReplicaLoad("r1", 0, 0, 0.0),
        ReplicaLoad("r2", 2, 0, 0.1),
    ]
    assert asyncio.run(router.route(job(PROMPT), 0.0, loads)) == "r1"


def test_session_affinity_sticks_to_one_replica_per_session() -> None:
    router = ScorerRouter(
        parse_policy("session_affinity"), FLEET, sink=None, clock=SimClock(), seed=0
    )
    picks = {asyncio.run(router.route(job([i, i + 1], "s1"), float(i), idle())) for i in range(5)}
    assert len(picks) == 1


def test_the_instant_router_reads_the_pools_directly() -> None:
    caches = {r: BlockPool(64, FLEET.block_size, ROOT) for r in FLEET.replica_ids()}
    admitted = caches["r1"].admit(0, PROMPT, len(PROMPT), chain=engine_chain(ROOT, PROMPT, 4))
    assert admitted is not None
    instant = InstantRouter(parse_policy("kv_aware_instant"), seed=0)
    with pytest.raises(SimulationError, match="watch"):
        asyncio.run(instant.route(job(PROMPT), 0.0, idle()))
    instant.watch(caches.__getitem__)
    assert asyncio.run(instant.route(job([*PROMPT, 5]), 0.0, idle())) == "r1"
    assert isinstance(stored(PROMPT)[0], BlockStored)


def test_load_reported_every_interval_is_seen_aging() -> None:
    """With load read every 10 s, least_load keeps choosing the replica that was idle at
    the last reading (herding), and the scorer sees that load's age."""
    clock = SimClock()
    router = ScorerRouter(
        parse_policy("least_load"), FLEET, sink=None, clock=clock, seed=0, load_interval_s=10.0
    )
    first = [
        ReplicaLoad("r0", 5, 1, 0.5),
        ReplicaLoad("r1", 0, 0, 0.0),
        ReplicaLoad("r2", 5, 1, 0.5),
    ]
    busy_r1 = [
        ReplicaLoad("r0", 0, 0, 0.0),
        ReplicaLoad("r1", 9, 9, 0.9),
        ReplicaLoad("r2", 0, 0, 0.0),
    ]
    assert asyncio.run(router.route(job(PROMPT), 0.0, first)) == "r1"
    assert asyncio.run(router.route(job(PROMPT), 5.0, busy_r1)) == "r1"  # not read yet
    assert asyncio.run(router.route(job(PROMPT), 10.0, busy_r1)) != "r1"  # read again
    instant = ScorerRouter(parse_policy("least_load"), FLEET, sink=None, clock=SimClock(), seed=0)
    assert asyncio.run(instant.route(job(PROMPT), 0.0, first)) == "r1"
    assert asyncio.run(instant.route(job(PROMPT), 5.0, busy_r1)) != "r1"
