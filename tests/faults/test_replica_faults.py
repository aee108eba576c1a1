"""Faults of a replica: killed (kill -9), then started again at the same address with an
empty cache, under traffic; or started again and left quiet (it publishes nothing).

A killed replica holds nothing: its stream must stop reading ``live`` within the bound
(it may keep a stale, discounted credit). Restarted under traffic, its first frames
(seqs from 0 again) show the restart: the index drops its old blocks and holds the new
ones. Restarted quiet, nothing shows it but a probe of the replica (the replay from 0
comes back empty): its old blocks must stop being credited within the probe's bound.
"""

from __future__ import annotations

import time

import pytest

from tests.faults.convergence import Recorder
from tests.faults.fleet import (
    PROBE_INTERVAL_S,
    REPLAY_TIMEOUT_S,
    FaultFleet,
    prompts_of,
    wait_agreement,
)
from tests.faults.scale import Scale

pytestmark = [pytest.mark.faults, pytest.mark.redis_server]

VICTIM = "r1"
DEAD_BOUND_S = 3.0
"""From the kill to its stream not live: the socket monitor's disconnect, then the fleet
state republished (every 1 s) and read by the API."""
RESTART_BOUND_S = 5.0
"""From the restarted replica's first request to agreement."""
QUIET_BOUND_S = PROBE_INTERVAL_S + REPLAY_TIMEOUT_S + 3.0
"""A restarted, quiet replica's old blocks dropped: one probe interval, a replay that
comes back empty, the fleet state republished (the expected behaviour of the quiet-restart
probe)."""


def _restart_victim(fleet: FaultFleet) -> None:
    fleet.replicas[VICTIM].child.start()


def test_replica_killed_then_restarted_under_traffic(
    fleet: FaultFleet, scale: Scale, recorder: Recorder
) -> None:
    for round_ in range(scale.num_rounds):
        before = prompts_of(f"rk{round_}", scale.num_prompts)
        fleet.drive(before)
        wait_agreement(fleet, before)
        fleet.replicas[VICTIM].child.kill()
        since = time.monotonic()
        recorder.converge(
            "replica kill -9 (not live)",
            fleet,
            before,
            since=since,
            bound_s=DEAD_BOUND_S,
            hold_s=scale.hold_s,
            dead=[VICTIM],
        )
        _restart_victim(fleet)
        since = time.monotonic()
        after = prompts_of(f"rka{round_}", scale.num_prompts)
        fleet.drive(after[: len(after) // 2] + before[: len(before) // 2])
        recorder.converge(
            "replica restarted, traffic",
            fleet,
            before + after,
            since=since,
            bound_s=RESTART_BOUND_S,
            hold_s=scale.hold_s,
        )


def test_replica_restarted_quiet_loses_its_old_credit(
    fleet: FaultFleet, scale: Scale, recorder: Recorder
) -> None:
    prompts = prompts_of("rq", scale.num_prompts)
    fleet.drive(prompts)
    wait_agreement(fleet, prompts)
    fleet.replicas[VICTIM].child.kill()
    _restart_victim(fleet)
    since = time.monotonic()
    fleet.wait_live([VICTIM], timeout_s=5.0)  # reconnected: nothing else tells it restarted
    recorder.converge(
        "replica restarted quiet",
        fleet,
        prompts,
        since=since,
        bound_s=QUIET_BOUND_S,
        hold_s=scale.hold_s,
    )
