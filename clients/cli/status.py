"""The indexer's periodic status: every ``--stats-every`` seconds, one INFO record on the
``kvindex.status`` logger with the fleet's totals, as one line and as fields (JSON logs)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvindex.indexer.fleet.registry import FleetTotals, Freshness, fleet_totals

if TYPE_CHECKING:
    from kvindex.indexer.service import IndexerService

__all__ = ["MAX_NAMED", "FleetStatus", "StatusLog", "fleet_status", "status_fields", "status_line"]

log = logging.getLogger("kvindex.status")

MAX_NAMED = 5
"""Streams named in a line per freshness state; more are counted as ``+N``."""


@dataclass(frozen=True, slots=True)
class FleetStatus:
    """The fleet's totals at one moment, with what a log line adds to them."""

    totals: FleetTotals
    streams_by_freshness: dict[Freshness, list[str]]
    """Every freshness state, each with its streams (``r1/0``), in stream order."""
    max_lag_s: float | None
    """The largest lag of a stream's last applied batch (None: no batch applied yet)."""
    partial: dict[str, tuple[str, float]] = field(default_factory=dict)
    """Each stream whose view is partial: (reason, since), whatever its freshness."""


def fleet_status(service: IndexerService) -> FleetStatus:
    """The totals of ``service``'s registry and index now (one index read per stream)."""
    statuses = service.registry.statuses()
    names: dict[Freshness, list[str]] = {state: [] for state in Freshness}
    partial: dict[str, tuple[str, float]] = {}
    for status in statuses:
        names[status.freshness].append(str(status.stream))
        health = status.health
        if health.partial is not None:
            partial[str(status.stream)] = (health.partial, health.partial_since or 0.0)
    lags = [s.health.lag_s for s in statuses if s.health.lag_s is not None]
    totals = fleet_totals(service.registry, service.index, statuses=statuses)
    return FleetStatus(totals, names, max(lags, default=None), partial)


def _named(state: Freshness, streams: list[str]) -> str:
    shown = f"{len(streams)} {state.value}"
    if state is Freshness.LIVE or not streams:
        return shown
    more = f", +{len(streams) - MAX_NAMED}" if len(streams) > MAX_NAMED else ""
    return f"{shown} ({', '.join(streams[:MAX_NAMED])}{more})"


def _num_unrouted(totals: FleetTotals) -> int:
    unrouted = totals.unrouted
    return unrouted.num_undecodable + unrouted.num_unidentified + unrouted.num_refused


def status_line(status: FleetStatus, batches_per_s: float | None) -> str:
    """``status`` as one line; ``batches_per_s`` None: not known yet."""
    totals, counters = status.totals, status.totals.counters
    num = totals.num_streams
    states = ", ".join(
        _named(s, names)
        for s, names in status.streams_by_freshness.items()
        if names or s not in _SHOWN_IF_ANY  # only a sharded fleet has orphans
    )
    blocks = " ".join(f"{t.name.lower()} {n:,}" for t, n in totals.blocks_by_tier.items())
    rate = "-" if batches_per_s is None else f"{batches_per_s:.1f}"
    lag = "-" if status.max_lag_s is None else f"{status.max_lag_s:.3f}s"
    num_unrouted = _num_unrouted(totals)
    return (
        (
            f"{num} stream{'' if num == 1 else 's'}: {states} · blocks {blocks} · {rate} batches/s"
            f" · lag max {lag} · gaps {counters.num_gaps} · replays {counters.num_replays}"
            f" · restarts {counters.num_restarts} · errors {counters.num_errors}"
        )
        + (f" · unrouted {num_unrouted}" if num_unrouted else "")
        + _partial(status.partial)
    )


_SHOWN_IF_ANY = (Freshness.ORPHANED, Freshness.PARTIAL)


def _partial(partial: dict[str, tuple[str, float]]) -> str:
    """`` · partial r1/0 replay_gap_past_buffer for 12s, ...`` (empty when none is)."""
    if not partial:
        return ""
    now = time.time()
    named = [f"{s} {why} for {max(0.0, now - since):.0f}s" for s, (why, since) in partial.items()]
    more = f", +{len(named) - MAX_NAMED}" if len(named) > MAX_NAMED else ""
    return " · partial " + ", ".join(named[:MAX_NAMED]) + more


def status_fields(status: FleetStatus, batches_per_s: float | None) -> dict[str, Any]:
    """What :func:`status_line` says, as the fields of the log record."""
    totals, counters = status.totals, status.totals.counters
    by_state = status.streams_by_freshness
    return {
        "num_streams": totals.num_streams,
        "num_streams_by_freshness": {s.value: len(names) for s, names in by_state.items()},
        "not_live": [
            name for s, names in by_state.items() if s is not Freshness.LIVE for name in names
        ],
        "blocks_by_tier": {t.name.lower(): n for t, n in totals.blocks_by_tier.items()},
        "batches_per_s": batches_per_s,
        "max_lag_s": status.max_lag_s,
        "num_gaps": counters.num_gaps,
        "num_replays": counters.num_replays,
        "num_restarts": counters.num_restarts,
        "num_errors": counters.num_errors,
        "num_unrouted": _num_unrouted(totals),
        "partial": {s: {"reason": r, "since": t} for s, (r, t) in status.partial.items()},
    }


@dataclass
class StatusLog:
    """While entered, logs the status of ``read_status()`` every ``every_s`` seconds on a
    thread of its own (``every_s`` <= 0: never); leaving joins the thread. A line's rate is
    over the time since the previous one."""

    read_status: Callable[[], FleetStatus]
    every_s: float
    clock: Callable[[], float] = time.monotonic
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _previous: tuple[float, int] | None = field(default=None, init=False)

    def record(self) -> tuple[str, dict[str, Any]]:
        """The status now, as a line and as fields, its rate since the previous call."""
        status = self.read_status()
        now = self.clock()
        rate = None
        if self._previous is not None and now > self._previous[0]:
            rate = (status.totals.counters.num_batches - self._previous[1]) / (
                now - self._previous[0]
            )
        self._previous = (now, status.totals.counters.num_batches)
        return status_line(status, rate), status_fields(status, rate)

    def line(self) -> str:
        return self.record()[0]

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                line, fields = self.record()
                log.info("%s", line, extra=fields)
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
