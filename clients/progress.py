"""Progress of a long run as plain lines on stderr, for a terminal and a log file alike:
``label: 1,200/8,000 requests (15%) · kv_aware · 0:42 elapsed · ETA 3:58``."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


def clock_text(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02}:{secs:02}" if hours else f"{minutes}:{secs:02}"


class ProgressLog:
    """Counts steps of ``total``; a line at most every ``every_s`` (0: none), and one at
    :meth:`finish` if any was printed. One thread advances it."""

    def __init__(
        self,
        label: str,
        total: int,
        *,
        every_s: float,
        unit: str = "requests",
        out: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._label, self._total, self._unit = label, total, unit
        self._every_s = every_s
        self._out = out
        self._clock = clock
        self._started = self._last = clock()
        self._printed = False
        self.done = 0
        self.stage = ""
        """Shown after the counts (e.g. the policy being run)."""

    def advance(self, steps: int = 1) -> None:
        self.done += steps
        now = self._clock()
        if self._every_s > 0 and now - self._last >= self._every_s:
            self._last = now
            self._print(now)

    def finish(self) -> None:
        if self._printed:
            self._print(self._clock())

    def _print(self, now: float) -> None:
        elapsed, total = now - self._started, max(self._total, self.done)
        share = self.done / total if total else 1.0
        parts = [f"{self._label}: {self.done:,}/{total:,} {self._unit} ({share:.0%})"]
        if self.stage:
            parts.append(self.stage)
        parts.append(f"{clock_text(elapsed)} elapsed")
        if 0 < self.done < total:
            parts.append(f"ETA {clock_text(elapsed / self.done * (total - self.done))}")
        out = self._out if self._out is not None else sys.stderr
        print(" · ".join(parts), file=out, flush=True)
        self._printed = True
