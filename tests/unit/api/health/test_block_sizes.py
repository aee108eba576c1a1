"""kvindex.api.health.block_sizes: which streams can never match, and one warning per stream."""

from __future__ import annotations

import logging

import pytest

from kvindex.api.config.settings import ApiSettings, ModelSpec
from kvindex.api.health.block_sizes import BlockSizeCheck, BlockSizeMismatch
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec


def fleet(*sizes: int, model: str = "m") -> Registry:
    """Replicas ``r0``, ``r1``... of ``model``, each stream publishing its size (0: none)."""
    registry = Registry(tuple(ReplicaSpec(f"r{i}", model) for i in range(len(sizes))))
    for i, size in enumerate(sizes):
        registry.record(StreamId(f"r{i}"), StreamReport(block_size=size, last_seq=0))
    return registry


def test_the_odd_stream_out_is_a_mismatch_against_the_most_common_size() -> None:
    check = BlockSizeCheck(ApiSettings(), fleet(16, 16, 32, 0))
    assert check.mismatches() == {StreamId("r2"): BlockSizeMismatch(StreamId("r2"), "m", 32, 16)}


def test_the_configured_size_wins_over_the_fleets() -> None:
    settings = ApiSettings(models=(ModelSpec("m", block_size=32),))
    check = BlockSizeCheck(settings, fleet(16, 16, 32))
    assert sorted(check.mismatches()) == [StreamId("r0"), StreamId("r1")]


def test_each_mismatch_is_warned_of_once(caplog: pytest.LogCaptureFixture) -> None:
    registry = fleet(16, 16, 32)
    check = BlockSizeCheck(ApiSettings(), registry)
    with caplog.at_level(logging.WARNING, logger="kvindex.api.health.block_sizes"):
        for _ in range(3):
            check.mismatches()
        registry.record(StreamId("r2"), StreamReport(block_size=64, last_seq=1))
        check.mismatches()
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "stream r2/0 publishes block size 32 but model m uses 16: it can never match",
        "stream r2/0 publishes block size 64 but model m uses 16: it can never match",
    ]


def test_a_fleet_of_one_size_has_no_mismatch() -> None:
    check = BlockSizeCheck(ApiSettings(), fleet(16, 16))
    assert check.mismatches() == {}
    assert check.models() == ["m"]
