"""Faults of the indexer process: killed (kill -9) and started again, stopped (SIGSTOP)
then resumed; the replicas keep taking requests meanwhile. The index must then agree with
every replica's real cache within the bound: the restarted indexer resumes each stream
from its watermark in Redis and replays what it missed; the resumed one drains its queue."""

from __future__ import annotations

import signal
import time

import pytest

from tests.faults.convergence import Recorder
from tests.faults.fleet import FaultFleet, prompts_of, wait_agreement
from tests.faults.scale import Scale

pytestmark = [pytest.mark.faults, pytest.mark.redis_server]

RESTART_BOUND_S = 8.0
"""From the new indexer's start (its process spawned) to agreement: the Python process's
start-up (1 to 4 s on a busy 2-core machine), connect, replay from the watermark."""
RESUME_BOUND_S = 3.0
"""From SIGCONT to agreement: the queued frames applied."""


def test_indexer_killed_then_restarted(fleet: FaultFleet, scale: Scale, recorder: Recorder) -> None:
    for round_ in range(scale.num_rounds):
        before = prompts_of(f"ik{round_}", scale.num_prompts)
        missed = prompts_of(f"ikd{round_}", scale.num_prompts)
        fleet.drive(before)
        wait_agreement(fleet, before)
        fleet.indexer.kill()
        fleet.drive(missed)  # published while no indexer listens: only replay has them
        time.sleep(scale.outage_s)
        since = time.monotonic()
        fleet.indexer.spawn()
        recorder.converge(
            "indexer kill -9, restart",
            fleet,
            before + missed,
            since=since,
            bound_s=RESTART_BOUND_S,
            hold_s=scale.hold_s,
        )


def test_indexer_stopped_then_resumed(fleet: FaultFleet, scale: Scale, recorder: Recorder) -> None:
    for round_ in range(scale.num_rounds):
        before = prompts_of(f"is{round_}", scale.num_prompts)
        queued = prompts_of(f"isd{round_}", scale.num_prompts)
        fleet.drive(before)
        wait_agreement(fleet, before)
        fleet.indexer.signal(signal.SIGSTOP)
        try:
            fleet.drive(queued)
            time.sleep(scale.outage_s)
        finally:
            fleet.indexer.signal(signal.SIGCONT)
        since = time.monotonic()
        recorder.converge(
            "indexer SIGSTOP, SIGCONT",
            fleet,
            before + queued,
            since=since,
            bound_s=RESUME_BOUND_S,
            hold_s=scale.hold_s,
        )
