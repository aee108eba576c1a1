"""The indexer's periodic status: one log line per period, for people reading its log.

``kvindex indexer`` and ``kvindex serve`` log, every ``--stats-every`` seconds, one INFO
record on the ``kvindex.status`` logger with the fleet's totals, e.g.::

    3 streams: 2 live, 0 replaying, 1 stale (r3/0) · blocks gpu 1,204 cpu 16 other 0 ·
    41.2 batches/s · lag max 0.012s · gaps 2 · replays 1 · restarts 0 · errors 0

(one line in the log). Counters are totals since the process started; the rate is over the
last period. Streams that are not live are named (the first :data:`MAX_NAMED`). The
command computes the totals (:class:`FleetStatus`); this module words and logs them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvindex.indexer.fleet.registry import FleetTotals, Freshness

__all__ = ["MAX_NAMED", "FleetStatus", "StatusLog", "status_line"]

log = logging.getLogger("kvindex.status")

MAX_NAMED = 5
"""Streams named in a line per freshness state; more are counted as ``+N``."""


@dataclass(frozen=True, slots=True)
class FleetStatus:
    """The fleet's totals at one moment, with what a log line adds to them."""

    totals: FleetTotals
    """Counters, streams and blocks added up (``fleet_totals``)."""
    streams_by_freshness: dict[Freshness, list[str]]
    """Every freshness state, each with its streams (``r1/0``), in stream order."""
    max_lag_s: float | None
    """The largest lag of a stream's last applied batch (None: no batch applied yet)."""


def _named(state: Freshness, streams: list[str]) -> str:
    shown = f"{len(streams)} {state.value}"
    if state is Freshness.LIVE or not streams:
        return shown
    more = f", +{len(streams) - MAX_NAMED}" if len(streams) > MAX_NAMED else ""
    return f"{shown} ({', '.join(streams[:MAX_NAMED])}{more})"


def status_line(status: FleetStatus, batches_per_s: float | None) -> str:
    """``status`` as one line (no newline); ``batches_per_s`` None: not known yet. Frames of
    the bound SUB that reached no stream are shown only when there are some."""
    totals, counters = status.totals, status.totals.counters
    num = totals.num_streams
    states = ", ".join(_named(s, names) for s, names in status.streams_by_freshness.items())
    blocks = " ".join(f"{t.name.lower()} {n:,}" for t, n in totals.blocks_by_tier.items())
    rate = "-" if batches_per_s is None else f"{batches_per_s:.1f}"
    lag = "-" if status.max_lag_s is None else f"{status.max_lag_s:.3f}s"
    unrouted = totals.unrouted
    num_unrouted = unrouted.num_undecodable + unrouted.num_unidentified + unrouted.num_refused
    return (
        f"{num} stream{'' if num == 1 else 's'}: {states} · blocks {blocks} · {rate} batches/s"
        f" · lag max {lag} · gaps {counters.num_gaps} · replays {counters.num_replays}"
        f" · restarts {counters.num_restarts} · errors {counters.num_errors}"
    ) + (f" · unrouted {num_unrouted}" if num_unrouted else "")


@dataclass
class StatusLog:
    """Logs :func:`status_line` of ``read_status()`` every ``every_s`` seconds on a thread
    of its own while entered as a context manager; ``every_s`` <= 0: never. Leaving the
    context stops and joins the thread. A line's rate is over the time since the previous
    line (the first: since the context was entered, as the indexer starts)."""

    read_status: Callable[[], FleetStatus]
    every_s: float
    clock: Callable[[], float] = time.monotonic
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _previous: tuple[float, int] | None = field(default=None, init=False)
    """(time, batches) at the previous line."""

    def line(self) -> str:
        """The status now, its rate measured since the previous call (none on the first)."""
        status = self.read_status()
        now = self.clock()
        rate = None
        if self._previous is not None and now > self._previous[0]:
            rate = (status.totals.counters.num_batches - self._previous[1]) / (
                now - self._previous[0]
            )
        self._previous = (now, status.totals.counters.num_batches)
        return status_line(status, rate)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                log.info("%s", self.line())
            except Exception as exc:  # a store that is down costs a line, not the status thread
                log.warning("status unavailable: %s: %s", type(exc).__name__, exc)

    def __enter__(self) -> StatusLog:
        self._previous = (self.clock(), 0)  # entered as the indexer starts: no batch yet
        if self.every_s > 0:
            self._thread = threading.Thread(target=self._run, name="kvindex-status", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
