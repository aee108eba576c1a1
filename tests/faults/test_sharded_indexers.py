"""Two sharded indexers on one Redis, one killed (kill -9) while the replicas publish: the
survivor takes its streams over within the bound (its lease runs out, the survivor's next
renew sees it, claims the streams, replays each from its stored watermark), and then every
replica's real cache is what the index credits (no block lost, none applied twice: pools
small enough that traffic evicts, so a block counted twice would stay credited), every
stored watermark is the replica's last seq, and every stream names the survivor as owner.
And the other way: an indexer that joins takes its streams back, the handover fenced."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis
import zmq

from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.ingest.membership import member_of, rendezvous_owner
from kvindex.indexer.ingest.replay import fetch_replay
from kvindex.indexer.redis.schema import Schema
from tests.faults.convergence import Recorder
from tests.faults.fleet import REPLAY_TIMEOUT_S, FaultFleet, FleetShape, prompts_of
from tests.faults.scale import Scale

pytestmark = [pytest.mark.faults, pytest.mark.redis_server]

SURVIVOR, VICTIM = "idx-a", "idx-b"
LEASE_TTL_S = 3.0
TAKEOVER_BOUND_S = LEASE_TTL_S + LEASE_TTL_S / 3 + REPLAY_TIMEOUT_S + 4.0
"""The stated bound (the lease runs out, the survivor's next renew, one replay) plus 4 s
for a loaded 2-core machine (ten processes: connect back-off, Python at work)."""


def _replicas_split(num_each: int) -> tuple[str, ...]:
    """Replica ids whose (only) stream goes to each indexer ``num_each`` times."""
    chosen: dict[str, list[str]] = {SURVIVOR: [], VICTIM: []}
    for i in range(1, 100):
        rid = f"r{i}"
        owner = rendezvous_owner(str(StreamId(rid)), [SURVIVOR, VICTIM])
        assert owner is not None
        if len(chosen[owner]) < num_each:
            chosen[owner].append(rid)
    return (*chosen[SURVIVOR], *chosen[VICTIM])


REPLICAS = _replicas_split(2)
VICTIMS = [r for r in REPLICAS if rendezvous_owner(str(StreamId(r)), [SURVIVOR, VICTIM]) == VICTIM]


@pytest.fixture
def shape() -> FleetShape:
    return FleetShape(
        replica_ids=REPLICAS,
        indexer_ids=(SURVIVOR, VICTIM),
        lease_ttl_s=LEASE_TTL_S,
        capacity_blocks=16,  # traffic evicts: a block applied twice would stay credited
    )


@pytest.fixture
def store(fleet: FaultFleet) -> Iterator[RedisIndex]:
    index = RedisIndex(redis.Redis(port=fleet.redis_port), Schema())
    yield index
    index.close()


def owners(fleet: FaultFleet) -> dict[str, str | None]:
    return {rid: view.get("owner") for rid, view in fleet.streams().items()}


def wait_owners(fleet: FaultFleet, wanted: dict[str, str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (seen := owners(fleet)) != wanted and time.monotonic() < deadline:
        time.sleep(0.1)
    assert seen == wanted


def last_seqs(fleet: FaultFleet) -> dict[str, int]:
    """Each replica's last published seq, from its own replay buffer."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        return {
            rid: fetch_replay(context, f"tcp://127.0.0.1:{r.replay_port}", 0)[-1].seq
            for rid, r in fleet.replicas.items()
        }
    finally:
        context.term()


def test_a_killed_indexer_streams_are_taken_over_within_the_bound(
    fleet: FaultFleet, scale: Scale, recorder: Recorder, store: RedisIndex
) -> None:
    split = {r: VICTIM if r in VICTIMS else SURVIVOR for r in REPLICAS}
    wait_owners(fleet, split, timeout_s=2 * LEASE_TTL_S)
    before = prompts_of("sh", scale.num_prompts)
    during = prompts_of("shd", 4 * scale.num_prompts)
    after = prompts_of("sha", scale.num_prompts)
    fleet.drive(before)
    driver = threading.Thread(target=fleet.drive, args=(during,))
    driver.start()
    try:
        time.sleep(0.1)  # the replicas are publishing now
        fleet.more_indexers[VICTIM].kill()
        since = time.monotonic()
    finally:
        driver.join()
    fleet.drive(after)  # published before any survivor owns the victim's streams
    seconds = recorder.converge(
        "one of 2 sharded indexers kill -9",
        fleet,
        before + during + after,
        since=since,
        bound_s=TAKEOVER_BOUND_S,
        hold_s=scale.hold_s,
    )
    print(f"\nstreams of {VICTIMS} taken over by {SURVIVOR} in {seconds:.2f} s")
    wait_owners(fleet, dict.fromkeys(REPLICAS, SURVIVOR), timeout_s=2.0)
    assert_resumed_exactly(fleet, store, dict.fromkeys(REPLICAS, SURVIVOR))


def test_a_joining_indexer_takes_its_streams_with_a_fenced_handover(
    fleet: FaultFleet, scale: Scale, recorder: Recorder, store: RedisIndex
) -> None:
    split = {r: VICTIM if r in VICTIMS else SURVIVOR for r in REPLICAS}
    joiner = fleet.more_indexers[VICTIM]
    wait_owners(fleet, split, timeout_s=2 * LEASE_TTL_S)
    joiner.stop()  # a clean stop gives its lease up at once
    wait_owners(fleet, dict.fromkeys(REPLICAS, SURVIVOR), timeout_s=2 * LEASE_TTL_S)
    before = prompts_of("jn", scale.num_prompts)
    during = prompts_of("jnd", 4 * scale.num_prompts)
    fleet.drive(before)
    driver = threading.Thread(target=fleet.drive, args=(during,))
    driver.start()
    try:
        since = time.monotonic()
        joiner.spawn()
        joiner.wait_ready(timeout_s=30.0)
    finally:
        driver.join()
    wait_owners(fleet, split, timeout_s=TAKEOVER_BOUND_S)
    seconds = recorder.converge(
        "an indexer joins (rebalance)",
        fleet,
        before + during,
        since=since,
        bound_s=TAKEOVER_BOUND_S + 5.0,  # + the joiner's start-up
        hold_s=scale.hold_s,
    )
    print(f"\nstreams of {VICTIMS} handed to the new {VICTIM} in {seconds:.2f} s")
    assert_resumed_exactly(fleet, store, split)
    handed = fleet.indexer.tail(20_000)
    assert all(f"replica {r} rank 0: handed to another indexer" in handed for r in VICTIMS)


def assert_resumed_exactly(fleet: FaultFleet, store: RedisIndex, owner_of: dict[str, str]) -> None:
    """Every stored watermark is the replica's last seq (nothing left behind), and the
    stream's fence names its owner."""
    seqs = last_seqs(fleet)
    for rid, member in owner_of.items():
        stream = StreamId(rid)
        assert store.stats(stream).watermark == seqs[rid], rid
        owner = store.owner(stream)
        assert owner is not None and member_of(owner) == member, (rid, owner)
