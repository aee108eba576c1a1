"""Faults of the Redis store under ``/score`` traffic: killed (kill -9) and restarted from
its append-only file, stopped (SIGSTOP) then resumed, restarted empty.

While Redis is down the API answers every ``/score`` within 250 ms, ``degraded``; the
replicas keep serving and publishing, and the indexer keeps running. Once Redis is back
the index must agree again with every replica's real cache within the bound.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from kvindex.api.config.settings import ApiSettings
from kvindex.clients.fake_vllm.tokenizer import (
    tokenize_text,
)
from tests.faults.convergence import Recorder
from tests.faults.fleet import MODEL, FaultFleet, prompts_of, wait_agreement
from tests.faults.scale import Scale
from tests.support.score_load import Sample, during, run_load

pytestmark = [pytest.mark.faults, pytest.mark.redis_server]

BUDGET_S = 0.25
"""Every ``/score`` answer while Redis is down (the issue's bar)."""
REDIS_TIMEOUT_S = ApiSettings().redis_timeout_s
RATE = 50.0
BOUND_S = 5.0
"""From Redis back to agreement: the indexer's store retries and a resync by replay."""
REFILL_BOUND_S = 5.0
"""From an empty Redis back to agreement: every stream replayed at once, not at its next
event (the expected behaviour of the store-refill change)."""


def _load(fleet: FaultFleet, prompt: str, scale: Scale) -> dict[str, Any]:
    body = {"model": MODEL, "token_ids": tokenize_text(prompt)}
    return {"body": body, "rate": RATE, "duration_s": scale.outage_s, "timeout_s": 2.0}


def _usual_latency(fleet: FaultFleet, prompt: str, scale: Scale) -> float:
    """The slowest answer of the same load with Redis up: the usual latency that, on a
    host other work slows down, the bound adds the API's Redis timeout to."""
    load = _load(fleet, prompt, scale)
    samples = run_load(fleet.api_url, load.pop("body"), concurrency=8, **load)
    return max(s.latency_s or 9.9 for s in samples)


def _assert_bounded_and_degraded(samples: list[Sample], scale: Scale, usual_s: float) -> None:
    assert len(samples) == round(RATE * scale.outage_s)
    limit = max(BUDGET_S, usual_s + REDIS_TIMEOUT_S + 0.05)
    late = [s.latency_s for s in samples if s.latency_s is None or s.latency_s > limit]
    assert late == [], f"{len(late)} of {len(samples)} answers later than {limit:.3f} s: {late[:5]}"
    assert {s.status for s in samples} == {200}
    assert all(s.degraded is not None for s in samples), "an answer while Redis was down"


def _outage(fleet: FaultFleet, scale: Scale, prompts: list[str], usual_s: float) -> None:
    """With Redis down: ``/score`` at 50/s while the replicas take ``prompts``; every
    answer within the usual latency (``usual_s``, measured before) plus the timeout."""
    load = _load(fleet, prompts[0], scale)
    with during(fleet.api_url, load.pop("body"), concurrency=8, **load) as run:
        started = time.monotonic()
        fleet.drive(prompts)
        time.sleep(max(0.0, scale.outage_s - (time.monotonic() - started)))
    _assert_bounded_and_degraded(run.samples, scale, usual_s)
    assert fleet.indexer.running, "the indexer exited while Redis was down"


def _fresh_traffic_is_indexed(fleet: FaultFleet, recorder: Recorder, tag: str) -> None:
    """After the fault, new requests are indexed as before."""
    fresh = prompts_of(f"{tag}-after", 4)
    fleet.drive(fresh)
    recorder.converge(
        f"{tag}: new traffic after", fleet, fresh, since=time.monotonic(), bound_s=2.0, hold_s=0.0
    )


def test_redis_killed_then_restarted_from_its_aof(
    fleet: FaultFleet, scale: Scale, recorder: Recorder
) -> None:
    for round_ in range(scale.num_rounds):
        before, during_ = (
            prompts_of(f"k{round_}", scale.num_prompts),
            prompts_of(f"kd{round_}", scale.num_prompts),
        )
        fleet.drive(before)
        wait_agreement(fleet, before)
        usual_s = _usual_latency(fleet, during_[0], scale)
        fleet.redis.kill()
        _outage(fleet, scale, during_, usual_s)
        fleet.restart_redis(empty=False)
        since = time.monotonic()
        recorder.converge(
            "redis kill -9, AOF restart",
            fleet,
            before + during_,
            since=since,
            bound_s=BOUND_S,
            hold_s=scale.hold_s,
        )
    _fresh_traffic_is_indexed(fleet, recorder, "redis kill -9")


def test_redis_stopped_then_resumed(fleet: FaultFleet, scale: Scale, recorder: Recorder) -> None:
    for round_ in range(scale.num_rounds):
        before, during_ = (
            prompts_of(f"s{round_}", scale.num_prompts),
            prompts_of(f"sd{round_}", scale.num_prompts),
        )
        fleet.drive(before)
        wait_agreement(fleet, before)
        usual_s = _usual_latency(fleet, during_[0], scale)
        fleet.redis.signal(signal.SIGSTOP)
        try:
            _outage(fleet, scale, during_, usual_s)
        finally:
            fleet.redis.signal(signal.SIGCONT)
        since = time.monotonic()
        recorder.converge(
            "redis SIGSTOP, SIGCONT",
            fleet,
            before + during_,
            since=since,
            bound_s=BOUND_S,
            hold_s=scale.hold_s,
        )
    _fresh_traffic_is_indexed(fleet, recorder, "redis SIGSTOP")


def test_redis_restarted_empty_is_refilled_at_once(
    fleet: FaultFleet, scale: Scale, recorder: Recorder
) -> None:
    """No traffic after the restart: the refill cannot wait for the streams' next events."""
    for round_ in range(scale.num_rounds):
        prompts = prompts_of(f"e{round_}", scale.num_prompts)
        fleet.drive(prompts)
        wait_agreement(fleet, prompts)
        fleet.redis.kill()
        fleet.restart_redis(empty=True)
        since = time.monotonic()
        recorder.converge(
            "redis restarted empty",
            fleet,
            prompts,
            since=since,
            bound_s=REFILL_BOUND_S,
            hold_s=scale.hold_s,
        )
    _fresh_traffic_is_indexed(fleet, recorder, "redis empty")
