"""The verdict rule: persisting over-predictions drop a replica's blocks and discount its cache
term until exact again; a model's token mismatch named once; under-predictions by reason."""

from __future__ import annotations

import logging

import pytest

from kvindex.clients.proxy.predictions import Prediction, Truth
from kvindex.clients.proxy.verdicts import VerdictRule, Verdicts, under_reason_of, view_clearer
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec


class Series:
    def __init__(self) -> None:
        self.verdicts: list[str] = []
        self.reasons: list[str] = []
        self.num_distrusted = 0
        self.num_models = 0

    def verdict(self, verdict: str) -> None:
        self.verdicts.append(verdict)

    def under_predicted(self, reason: str) -> None:
        self.reasons.append(reason)

    def distrusted(self, num_replicas: int) -> None:
        self.num_distrusted = num_replicas

    def mismatched(self, num_models: int) -> None:
        self.num_models = num_models


RULE = VerdictRule(10, 3, 5)


def _verdicts(rule: VerdictRule = RULE) -> tuple[Verdicts, Series, list[str]]:
    series, cleared = Series(), []

    def clear(replica: str) -> bool:
        cleared.append(replica)
        return True

    return Verdicts(rule, series, clear_view=clear), series, cleared


def _judge(verdicts: Verdicts, replica: str, *outcomes: str) -> None:
    for outcome in outcomes:
        verdicts.judge(Prediction(replica, "m", 100, 64, 16), Truth(100, 64), outcome)


def test_the_limit_th_over_prediction_in_the_window_is_the_verdict() -> None:
    verdicts, series, cleared = _verdicts()
    _judge(verdicts, "r1", "over_predicted", "exact", "over_predicted", "unreported")
    assert cleared == [] and verdicts.distrusted() == frozenset()
    _judge(verdicts, "r1", "over_predicted")
    assert cleared == ["r1"] and verdicts.distrusted() == {"r1"}
    assert series.verdicts == ["over_predicted"] and series.num_distrusted == 1
    _judge(verdicts, "r2", *["exact"] * 20)  # another replica is judged on its own
    assert verdicts.distrusted() == {"r1"}


def test_over_predictions_older_than_the_window_do_not_count() -> None:
    verdicts, _, cleared = _verdicts()
    for _ in range(10):  # 2 in every 10: never 3 in the last 10
        _judge(verdicts, "r1", "over_predicted", "over_predicted", *["exact"] * 8)
    assert cleared == []


def test_the_discount_lifts_after_exact_to_trust_exact_since_the_last_over() -> None:
    verdicts, series, _ = _verdicts()
    _judge(verdicts, "r1", *["over_predicted"] * 3)
    _judge(verdicts, "r1", "exact", "exact", "under_predicted", "over_predicted")
    _judge(verdicts, "r1", "exact", "exact", "exact", "under_predicted", "exact")
    assert verdicts.distrusted() == {"r1"}  # 4 exact since the last over
    _judge(verdicts, "r1", "exact")
    assert verdicts.distrusted() == frozenset() and series.num_distrusted == 0
    assert verdicts.view("r1") == {
        "distrusted": False,
        "num_verdicts": 1,
        "under_predicted": {"lost_stores": 2},
    }


def test_the_window_restarts_after_a_verdict_so_a_second_needs_limit_more() -> None:
    verdicts, _, cleared = _verdicts()
    _judge(verdicts, "r1", *["over_predicted"] * 5)
    assert cleared == ["r1"]
    _judge(verdicts, "r1", "over_predicted")
    assert cleared == ["r1", "r1"]


def test_a_token_mismatch_is_logged_once_per_model(caplog: pytest.LogCaptureFixture) -> None:
    verdicts, series, cleared = _verdicts()
    caplog.set_level(logging.WARNING, "kvindex.proxy")
    for replica in ("r1", "r2", "r1"):
        verdicts.judge(Prediction(replica, "m", 57, 0, 16), Truth(58, 0), "token_mismatch")
    verdicts.judge(Prediction("r1", "other", 9, 0, 16), Truth(8, 0), "token_mismatch")
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2
    assert "model 'm': the router counts 57 tokens, the engine 58 (routed to r1)" in logged[0]
    assert [m.model for m in verdicts.mismatches()] == ["m", "other"]
    assert series.verdicts == ["token_mismatch"] * 2 and series.num_models == 2
    assert cleared == [] and verdicts.distrusted() == frozenset()


def test_an_under_prediction_is_named_by_the_replicas_streams() -> None:
    registry = Registry((ReplicaSpec("r1", "m"), ReplicaSpec("r2", "m")))
    registry = Registry((*registry.replicas(), ReplicaSpec("r3", "m")))
    partial = StreamReport(last_seq=3, last_event_ts=1.0, partial="cleared_on_over_predictions")
    registry.record(StreamId("r1"), partial)
    registry.record(StreamId("r2"), StreamReport(last_seq=3, last_event_ts=1.0, block_size=16))
    registry.record(StreamId("r3"), StreamReport(last_seq=3, last_event_ts=1.0, block_size=32))
    reason = under_reason_of(registry)
    found = [reason(Prediction(r, "m", 100, 0, 16)) for r in ("r1", "r2", "r3")]
    assert found == ["partial_view", "lost_stores", "block_size"]


def test_a_registry_is_asked_to_clear_a_replica() -> None:
    registry = Registry((ReplicaSpec("r1", "m"),))
    assert view_clearer(registry)("r1") is True
    assert set(registry.clear_asks()) == {"r1"}


def test_an_under_predictions_reason_is_read_at_most_once_a_second_per_replica() -> None:
    registry, now = Registry((ReplicaSpec("r1", "m"),)), [0.0]
    reason = under_reason_of(registry, clock=lambda: now[0])
    prediction = Prediction("r1", "m", 100, 0, 16)
    registry.record(StreamId("r1"), StreamReport(last_seq=3, last_event_ts=1.0, block_size=16))
    assert reason(prediction) == "lost_stores"
    registry.record(StreamId("r1"), StreamReport(block_size=32))
    now[0] = 0.5
    assert reason(prediction) == "lost_stores"
    now[0] = 1.5
    assert reason(prediction) == "block_size"
