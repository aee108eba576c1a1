"""The indexer's periodic status line (clients/cli/status.py), without an indexer."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

import pytest

from kvindex.clients.cli.status import MAX_NAMED, FleetStatus, StatusLog, status_line
from kvindex.indexer.domain.events import Tier
from kvindex.indexer.domain.health import StreamCounters, UnroutedCounters
from kvindex.indexer.fleet.registry import FleetTotals, Freshness


def fleet(live: int = 2, stale: tuple[str, ...] = ("r3/0",), num_batches: int = 100) -> FleetStatus:
    counters = StreamCounters(
        num_batches=num_batches, num_gaps=2, num_replays=1, num_decode_errors=2, num_bad_events=1
    )
    names = {
        Freshness.LIVE: [f"r{i + 1}/0" for i in range(live)],
        Freshness.REPLAYING: [],
        Freshness.STALE: list(stale),
    }
    by_freshness = {state: len(streams) for state, streams in names.items()}
    blocks = {Tier.GPU: 1204, Tier.CPU: 16, Tier.OTHER: 0}
    totals = FleetTotals(live + len(stale), live + len(stale), by_freshness, blocks, counters)
    return FleetStatus(totals, names, max_lag_s=0.0123)


def test_the_line_has_every_total() -> None:
    assert status_line(fleet(), 41.25) == (
        "3 streams: 2 live, 0 replaying, 1 stale (r3/0) · blocks gpu 1,204 cpu 16 other 0"
        " · 41.2 batches/s · lag max 0.012s · gaps 2 · replays 1 · restarts 0 · errors 3"
    )


def test_the_line_shows_frames_that_reached_no_stream_when_there_are_some() -> None:
    status = fleet()
    totals = replace(status.totals, unrouted=UnroutedCounters(num_undecodable=4, num_refused=1))
    line = status_line(replace(status, totals=totals), 41.25)
    assert line.endswith(" · errors 3 · unrouted 5")


def test_the_line_before_any_batch_or_rate() -> None:
    nothing = FleetTotals(
        0, 0, dict.fromkeys(Freshness, 0), dict.fromkeys(Tier, 0), StreamCounters()
    )
    empty = FleetStatus(nothing, {state: [] for state in Freshness}, None)
    line = status_line(empty, None)
    assert line.startswith("0 streams: 0 live, 0 replaying, 0 stale · blocks gpu 0")
    assert "- batches/s · lag max -" in line
    one = status_line(fleet(live=1, stale=()), None)
    assert one.startswith("1 stream: 1 live,")


def test_streams_that_are_not_live_are_named_up_to_a_limit() -> None:
    stale = tuple(f"s{i}/0" for i in range(MAX_NAMED + 2))
    line = status_line(fleet(live=0, stale=stale), 0.0)
    shown = ", ".join(stale[:MAX_NAMED])
    assert f"{len(stale)} stale ({shown}, +2)" in line
    assert "\n" not in line


def test_the_rate_is_over_the_time_since_the_previous_line() -> None:
    now, batches = [0.0], [0]
    log = StatusLog(lambda: fleet(num_batches=batches[0]), 5.0, clock=lambda: now[0])
    assert "- batches/s" in log.line()  # no previous line: no rate
    now[0], batches[0] = 10.0, 250
    assert "25.0 batches/s" in log.line()
    now[0] = 15.0
    assert "0.0 batches/s" in log.line()


def test_one_log_record_per_period_until_left(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvindex.status")
    before = set(threading.enumerate())
    with StatusLog(fleet, 0.02):
        deadline = time.monotonic() + 5
        while len(caplog.records) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert set(threading.enumerate()) <= before  # the thread is joined
    records = [r for r in caplog.records if r.name == "kvindex.status"]
    assert len(records) >= 3
    assert all(r.levelno == logging.INFO and "\n" not in r.getMessage() for r in records)
    assert records[0].getMessage().startswith("3 streams: 2 live")


def test_no_thread_when_the_period_is_zero(caplog: pytest.LogCaptureFixture) -> None:
    before = set(threading.enumerate())
    with StatusLog(fleet, 0):
        assert set(threading.enumerate()) <= before
    assert not caplog.records


def test_a_failing_read_costs_a_line_not_the_thread(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvindex.status")
    calls = [0]

    def flaky() -> FleetStatus:
        calls[0] += 1
        if calls[0] == 1:
            raise ConnectionError("redis down")
        return fleet()

    with StatusLog(flaky, 0.02):
        deadline = time.monotonic() + 5
        while len(caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    first, second = caplog.records[:2]
    assert first.levelno == logging.WARNING
    assert first.getMessage() == "status unavailable: ConnectionError: redis down"
    assert second.levelno == logging.INFO


def test_the_record_carries_the_totals_as_fields(caplog: pytest.LogCaptureFixture) -> None:
    """For JSON logs: the line's numbers as fields, not only inside the message."""
    caplog.set_level(logging.INFO, logger="kvindex.status")
    with StatusLog(fleet, 0.02):
        deadline = time.monotonic() + 5
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
    fields = vars(caplog.records[0])
    assert fields["num_streams"] == 3
    assert fields["num_streams_by_freshness"] == {"live": 2, "replaying": 0, "stale": 1}
    assert fields["not_live"] == ["r3/0"]
    assert fields["blocks_by_tier"] == {"gpu": 1204, "cpu": 16, "other": 0}
    assert (fields["max_lag_s"], fields["num_gaps"], fields["num_errors"]) == (0.0123, 2, 3)
    assert fields["num_unrouted"] == 0 and "batches_per_s" in fields


def test_partial_views_are_named_with_their_reason_and_age() -> None:
    status = fleet(live=1, stale=())
    names = {s: status.streams_by_freshness.get(s, []) for s in Freshness}  # as fleet_status
    names[Freshness.PARTIAL] = ["r2/0"]
    partial = {"r2/0": ("replay_gap_past_buffer", time.time() - 42)}
    line = status_line(replace(status, streams_by_freshness=names, partial=partial), 1.0)
    assert "1 live, 1 partial (r2/0), 0 replaying" in line
    assert line.endswith(" · partial r2/0 replay_gap_past_buffer for 42s")
    assert ", 0 partial" not in status_line(status, 1.0)  # named only when there is one
