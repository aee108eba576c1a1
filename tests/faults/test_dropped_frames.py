"""Frames dropped past the replicas' send high-water mark: the indexer is stopped
(SIGSTOP) while the replicas take a flood of long prompts (each evicts the whole pool), so
their PUB queues overflow and live frames are lost; then the indexer resumes and traffic
goes on until a later frame shows the gap (the indexer's receive queue is bounded, so while
it drains the backlog, traffic can overflow the replicas' small queues again).

With a replay endpoint, the gap is repaired by replay: the index agrees exactly again.
Without one, the stream's history is lost: no block whose eviction was dropped may stay
credited (the stream is cleared: the expected behaviour of the unrepairable-gap change),
and what the replica stores afterwards is credited.

One round per test, in both forms: once the indexer has drained a flood, its TCP receive
buffer has grown (Linux autotunes it up to megabytes), so a second flood on the same
connection may overflow nothing. The long form floods five times more instead.
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
PROBE_WORDS = 64
"""Each flood prompt is checked on its first 4 blocks (a stale credit shows there: a
longest prefix starts at the first block), the last two in full."""


def bound_s(scale: Scale) -> float:
    """From SIGCONT to agreement: the queued frames drained, the gap seen, then the replay
    applied (or the stream cleared) — 3 s plus 1 s per 30 flood prompts (5 s in the short
    form, 13 s in the long one)."""
    return 3.0 + scale.num_flood / 30


def _flood_while_stopped(fleet: FaultFleet, scale: Scale) -> list[str]:
    """Stop the indexer, flood both replicas, resume it; the prompts to check after."""
    flood = prompts_of("flood", scale.num_flood, num_words=FLOOD_WORDS, shared=0)
    fleet.indexer.signal(signal.SIGSTOP)
    try:
        fleet.drive(flood)
    finally:
        fleet.indexer.signal(signal.SIGCONT)
    return [" ".join(p.split()[:PROBE_WORDS]) for p in flood] + flood[-2:]


def _drive_gently(fleet: FaultFleet, prompts: list[str], chunk: int = 8) -> None:
    """Drive ``prompts`` a few at a time, each batch indexed before the next: with so small
    an HWM, a burst while the indexer merely lags would already lose frames."""
    for start in range(0, len(prompts), chunk):
        fleet.drive(prompts[start : start + chunk])
        wait_agreement(fleet, prompts[start : start + chunk])


def _num_gaps(fleet: FaultFleet) -> int:
    return sum(s["counters"]["num_gaps"] for s in fleet.streams().values())


def _reveal_gap(fleet: FaultFleet, gaps: int, prefix: str) -> list[str]:
    """Drive two prompts at a time until the streams count a new gap: the indexer has then
    drained the flood's backlog (its receive queue is bounded, so the backlog waits in TCP
    and in the replicas' 8-message queues, and traffic sent while it drains can be dropped
    too). Returns the prompts driven, for the check's lost history."""
    driven: list[str] = []
    deadline = time.monotonic() + 5.0
    while _num_gaps(fleet) <= gaps and time.monotonic() < deadline:
        prompts = prompts_of(f"{prefix}{len(driven)}", 2)
        fleet.drive(prompts)
        driven += prompts
        time.sleep(0.2)
    return driven


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
    before = prompts_of("h", scale.num_prompts)
    _drive_gently(fleet, before)
    gaps = _num_gaps(fleet)
    flooded = _flood_while_stopped(fleet, scale)
    since = time.monotonic()
    revealed = _reveal_gap(fleet, gaps, "hr")  # traffic goes on: its frames show the gap
    after = prompts_of("ha", 4)
    fleet.drive(after)
    recorder.converge(
        "frames dropped past HWM, replay",
        fleet,
        before + flooded + revealed + after,
        since=since,
        bound_s=bound_s(scale),
        hold_s=scale.hold_s,
    )
    _wait_gaps_seen(fleet, gaps + 1)


@pytest.mark.parametrize(
    "shape", [FleetShape(send_hwm=SEND_HWM, replay=False, capacity_blocks=CAPACITY_BLOCKS)]
)
def test_frames_dropped_past_the_hwm_without_replay_leave_no_stale_credit(
    fleet: FaultFleet, scale: Scale, recorder: Recorder
) -> None:
    before = prompts_of("n", scale.num_prompts)
    _drive_gently(fleet, before)
    gaps = _num_gaps(fleet)
    flooded = _flood_while_stopped(fleet, scale)
    since = time.monotonic()
    reveal = _reveal_gap(fleet, gaps, "nr")  # shows the gap; cleared with the lost history
    fresh = prompts_of("nf", 4)
    fleet.drive(fresh)
    recorder.converge(
        "frames dropped past HWM, no replay",
        fleet,
        fresh,
        since=since,
        bound_s=bound_s(scale),
        hold_s=scale.hold_s,
        history=before + flooded + reveal,
    )
    _wait_gaps_seen(fleet, gaps + 1)
