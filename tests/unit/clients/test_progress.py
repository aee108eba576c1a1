"""kvindex.clients.progress: rate-limited lines with done/total and an ETA."""

from __future__ import annotations

import io

from kvindex.clients.progress import ProgressLog, clock_text


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_line_every_interval_with_the_eta_and_a_last_one_at_the_end() -> None:
    out, clock = io.StringIO(), FakeClock()
    progress = ProgressLog("simulate", 100, every_s=5.0, out=out, clock=clock)
    for _ in range(10):  # 1 s each: a line at 5 s and at 10 s, not in between
        clock.now += 1.0
        progress.advance(5)
    progress.stage = "kv_aware"
    progress.finish()
    lines = out.getvalue().splitlines()
    assert lines[0] == "simulate: 25/100 requests (25%) · 0:05 elapsed · ETA 0:15"
    assert lines[1] == "simulate: 50/100 requests (50%) · 0:10 elapsed · ETA 0:10"
    assert lines[2] == "simulate: 50/100 requests (50%) · kv_aware · 0:10 elapsed · ETA 0:10"
    assert len(lines) == 3


def test_a_short_run_or_interval_zero_prints_nothing() -> None:
    for every_s in (0.0, 60.0):
        out, clock = io.StringIO(), FakeClock()
        progress = ProgressLog("analyze", 3, every_s=every_s, out=out, clock=clock)
        for _ in range(3):
            clock.now += 10.0 if every_s == 0 else 1.0
            progress.advance()
        progress.finish()
        assert out.getvalue() == ""


def test_clock_text() -> None:
    assert [clock_text(s) for s in (0, 61.9, 3600 + 62)] == ["0:00", "1:01", "1:01:02"]
