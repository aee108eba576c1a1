"""Two sharded indexers on one Redis, one killed (kill -9) while the replicas publish: the
survivor takes its streams over within the bound (its lease runs out, the survivor's next
renew sees it, claims the streams, replays each from its stored watermark), and then every
replica's real cache is what the index credits (no block lost, none applied twice: pools
small enough that traffic evicts, so a block counted twice would stay credited), every
stored watermark is the replica's last seq, and every stream names the survivor as owner.
And the other way: an indexer that joins takes its streams back, the handover fenced. An
indexer paused past its lease publishes nothing stale when it wakes, a stream no live
indexer keeps reads orphaned until one takes it over, and a claim made after its owner's is
found and taken back."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from typing import cast

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


def published(client: redis.Redis) -> dict[str, tuple[str | None, int]]:
    """Each stream's record as stored for API processes: (owner, last_seq)."""
    raw = cast("dict[bytes, bytes]", client.hgetall(Schema().stream_status))
    out = {}
    for field, value in raw.items():
        if not field.startswith(b"#"):
            record = json.loads(value)
            out[field.decode()] = (record.get("owner"), record["live"]["last_seq"])
    return out


def test_a_paused_indexer_past_its_lease_publishes_nothing_stale_when_it_wakes(
    fleet: FaultFleet, scale: Scale
) -> None:
    """SIGSTOP past the lease, SIGCONT: the woken indexer never republishes what it had
    (no record of it going back in seq), and each stream changes owner at most once after
    (the survivor, then the woken one as a new member)."""
    split = {r: VICTIM if r in VICTIMS else SURVIVOR for r in REPLICAS}
    wait_owners(fleet, split, timeout_s=2 * LEASE_TTL_S)
    victim = fleet.more_indexers[VICTIM]
    client = redis.Redis(port=fleet.redis_port)
    stop = threading.Event()
    driver = threading.Thread(target=_drive_until, args=(fleet, stop, scale.num_prompts))
    driver.start()
    try:
        victim.signal(signal.SIGSTOP)
        wait_owners(fleet, dict.fromkeys(REPLICAS, SURVIVOR), timeout_s=TAKEOVER_BOUND_S)
        history = {s: [seen] for s, seen in _fallen_behind(client, timeout_s=5.0).items()}
        victim.signal(signal.SIGCONT)
        deadline = time.monotonic() + 3 * LEASE_TTL_S
        while time.monotonic() < deadline:
            now = published(client)
            for stream, seen in history.items():
                if now.get(stream) != seen[-1]:
                    seen.append(now[stream])
            time.sleep(0.01)
    finally:
        stop.set()
        driver.join()
    client.close()
    for stream, seen in history.items():
        owners_seen = [
            owner for i, (owner, _) in enumerate(seen) if i == 0 or owner != seen[i - 1][0]
        ]
        print(f"\n{stream}: owners after SIGCONT {owners_seen}, (owner, last_seq) {seen[:12]}")
        assert owners_seen in ([SURVIVOR], [SURVIVOR, VICTIM]), (stream, seen)
        top = -1
        for owner, seq in seen:
            assert seq < 0 or seq >= top, f"{stream}: {owner} republished seq {seq} < {top}"
            top = max(top, seq)
    wait_owners(fleet, split, timeout_s=TAKEOVER_BOUND_S)


def _fallen_behind(client: redis.Redis, timeout_s: float) -> dict[str, tuple[str | None, int]]:
    """The victims' streams once the survivor has published some batches past the paused
    indexer's last ones (so a stale record would show)."""
    streams = [f"{r}/0" for r in VICTIMS]
    first = published(client)
    deadline = time.monotonic() + timeout_s
    while True:
        now = published(client)
        if all(now[s][0] == SURVIVOR and now[s][1] >= first[s][1] + 20 for s in streams):
            return {s: now[s] for s in streams}
        assert time.monotonic() < deadline, f"the survivor publishes no progress: {now}"
        time.sleep(0.05)


def _drive_until(fleet: FaultFleet, stop: threading.Event, num_prompts: int) -> None:
    """Traffic to every replica until ``stop``: each stream keeps publishing."""
    round_ = 0
    while not stop.is_set():
        fleet.drive(prompts_of(f"ps{round_}", num_prompts))
        round_ += 1


def test_a_stream_no_live_indexer_keeps_reads_orphaned_until_taken_over(
    fleet: FaultFleet,
) -> None:
    """The only live indexer paused: past its lease its streams read ``orphaned`` (never
    ``live``) in the API, until a new indexer takes them over."""
    keeper, joiner = fleet.indexer, fleet.more_indexers[VICTIM]
    joiner.stop()  # a clean stop gives its lease up at once
    wait_owners(fleet, dict.fromkeys(REPLICAS, SURVIVOR), timeout_s=2 * LEASE_TTL_S)
    keeper.signal(signal.SIGSTOP)
    try:
        paused = time.monotonic()
        states = _wait_states(fleet, {"orphaned"}, timeout_s=LEASE_TTL_S + 3.0)
        print(f"\norphaned {time.monotonic() - paused:.2f} s after SIGSTOP: {states}")
        joiner.spawn()
        joiner.wait_ready(timeout_s=30.0)
        wait_owners(fleet, dict.fromkeys(REPLICAS, VICTIM), timeout_s=TAKEOVER_BOUND_S)
        _wait_states(fleet, {"live", "replaying"}, timeout_s=TAKEOVER_BOUND_S)
    finally:
        keeper.signal(signal.SIGCONT)


def _wait_states(fleet: FaultFleet, wanted: set[str], timeout_s: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        states = {r: v.get("freshness", {}).get("state") for r, v in fleet.streams().items()}
        if set(states) == set(REPLICAS) and set(states.values()) <= wanted:
            return cast("dict[str, str]", states)
        assert time.monotonic() < deadline, f"streams not {wanted}: {states}"
        time.sleep(0.1)


def test_a_quiet_stream_claimed_since_by_another_token_is_claimed_back(
    fleet: FaultFleet, store: RedisIndex
) -> None:
    """A claim made after its owner's (as an indexer whose view lagged a join makes one):
    with no batch to be refused, the owner's next renew finds the claim lost, lets the
    stream go and claims it back a renew period later; the API reads it live again."""
    split = {r: VICTIM if r in VICTIMS else SURVIVOR for r in REPLICAS}
    wait_owners(fleet, split, timeout_s=2 * LEASE_TTL_S)
    stream = StreamId(VICTIMS[0])
    client = redis.Redis(port=fleet.redis_port)
    late = f"{SURVIVOR}#late"
    try:
        client.hset(Schema().stream_owners, str(stream), late)
        since = time.monotonic()
        while (claim := _claim_of(client, stream)) == late:
            assert time.monotonic() < since + 2 * LEASE_TTL_S, f"{stream}: the late claim stands"
            time.sleep(0.05)
    finally:
        client.close()
    print(f"\n{stream} claimed back in {time.monotonic() - since:.2f} s")
    assert member_of(claim) == VICTIM
    owner = store.owner(stream)
    assert owner is not None and member_of(owner) == VICTIM
    _wait_states(fleet, {"live"}, timeout_s=2 * LEASE_TTL_S)
    assert f"stream {stream}: owned by another indexer now" in fleet.more_indexers[VICTIM].tail(
        20_000
    )


def _claim_of(client: redis.Redis, stream: StreamId) -> str:
    return cast("bytes", client.hget(Schema().stream_owners, str(stream))).decode()
