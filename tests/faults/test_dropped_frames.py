"""Frames dropped past the replicas' send high-water mark: the indexer is stopped
(SIGSTOP) while the replicas take a flood of long prompts (each evicts the whole pool), so
their PUB queues overflow and live frames are lost; then the indexer resumes and traffic
goes on (a later frame is what shows the gap).

With a replay endpoint, the gap is repaired by replay: the index agrees exactly again.
Without one, the stream's history is lost: no block whose eviction was dropped may stay
credited (the stream is cleared: the expected behaviour of the unrepairable-gap change),
and what the replica stores afterwards is credited.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.faults.convergence import Recorder
from tests.faults.fleet import FaultFleet, FleetShape, prompts_of, wait_agreement
from tests.faults.scale import Scale

pytestmark = [pytest.mark.faults, pytest.mark.redis_server]

SEND_HWM = 8
CAPACITY_BLOCKS = 256
FLOOD_WORDS = 4000
"""Tokens of a flood prompt: 250 of the pool's 256 blocks, so each evicts all the others
(and its batch, ~16 KB, fills the queues fast)."""
REPAIR_BOUND_S = 5.0
"""From SIGCONT to agreement: the queue drained, the gap seen, the replay applied."""
CLEAR_BOUND_S = 3.0
"""From SIGCONT to no stale credit: the queue drained, the gap seen, the stream cleared."""


def _flood_while_stopped(fleet: FaultFleet, scale: Scale, tag: str) -> list[str]:
    """Stop the indexer, flood both replicas, resume it; the flood's prompts."""
    flood = prompts_of(f"{tag}-flood", scale.num_flood, num_words=FLOOD_WORDS, shared=0)
    fleet.indexer.signal(signal.SIGSTOP)
    try:
        fleet.drive(flood)
    finally:
        fleet.indexer.signal(signal.SIGCONT)
    return flood


def _num_gaps(fleet: FaultFleet) -> int:
    return sum(s["counters"]["num_gaps"] for s in fleet.streams().values())


def _wait_gaps_seen(fleet: FaultFleet, at_least: int) -> None:
    """The fault did happen: the streams counted a gap (published within the sync period)."""
    deadline = time.monotonic() + 3.0
    while _num_gaps(fleet) < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _num_gaps(fleet) >= at_least, f"no frame was dropped: {fleet.streams()}"


@pytest.mark.parametrize("shape", [FleetShape(send_hwm=SEND_HWM, capacity_blocks=CAPACITY_BLOCKS)])
def test_frames_dropped_past_the_hwm_are_repaired_by_replay(
    fleet: FaultFleet, scale: Scale, recorder: Recorder
) -> None:
    for round_ in range(scale.num_rounds):
        before = prompts_of(f"h{round_}", scale.num_prompts)
        fleet.drive(before)
        wait_agreement(fleet, before)
        gaps = _num_gaps(fleet)
        flood = _flood_while_stopped(fleet, scale, f"h{round_}")
        since = time.monotonic()
        after = prompts_of(f"ha{round_}", 4)
        fleet.drive(after)  # traffic goes on: its frames show the gap
        recorder.converge(
            "frames dropped past HWM, replay",
            fleet,
            before + flood + after,
            since=since,
            bound_s=REPAIR_BOUND_S,
            hold_s=scale.hold_s,
        )
        _wait_gaps_seen(fleet, gaps + 1)


@pytest.mark.parametrize(
    "shape", [FleetShape(send_hwm=SEND_HWM, replay=False, capacity_blocks=CAPACITY_BLOCKS)]
)
def test_frames_dropped_past_the_hwm_without_replay_leave_no_stale_credit(
    fleet: FaultFleet, scale: Scale, recorder: Recorder
) -> None:
    for round_ in range(scale.num_rounds):
        before = prompts_of(f"n{round_}", scale.num_prompts)
        fleet.drive(before)
        wait_agreement(fleet, before)
        gaps = _num_gaps(fleet)
        flood = _flood_while_stopped(fleet, scale, f"n{round_}")
        since = time.monotonic()
        reveal = prompts_of(f"nr{round_}", 2)
        fleet.drive(reveal)  # shows the gap; may be cleared with the lost history
        fresh = prompts_of(f"nf{round_}", 4)
        fleet.drive(fresh)
        recorder.converge(
            "frames dropped past HWM, no replay",
            fleet,
            fresh,
            since=since,
            bound_s=CLEAR_BOUND_S,
            hold_s=scale.hold_s,
            history=before + flood + reveal,
        )
        _wait_gaps_seen(fleet, gaps + 1)
