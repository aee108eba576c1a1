"""Convergence after a fault: how long until the index agrees with the replicas again, and
whether any answer after that credits a block a replica does not hold (a wrong route) or
misses one it holds (a lost block)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tests.faults.fleet import FaultFleet, Mismatch

POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class Convergence:
    """One measure: a fault, its convergence time (None: not within the bound), and what
    the answers checked after the bound showed."""

    fault: str
    seconds: float | None
    bound_s: float
    num_checked: int
    """``/score`` answers checked once converged (or at the bound)."""
    num_wrong_routes: int
    """Blocks credited to a replica that does not hold them, summed over those answers."""
    num_lost_blocks: int
    """Blocks a replica holds that its answers did not credit, summed likewise."""


@dataclass
class Recorder:
    results: list[Convergence]

    def converge(
        self,
        fault: str,
        fleet: FaultFleet,
        prompts: Sequence[str],
        *,
        since: float,
        bound_s: float,
        hold_s: float,
        dead: Iterable[str] = (),
        history: Sequence[str] = (),
    ) -> float:
        """Poll until every prompt's ``/score`` credit equals each replica's real cache;
        then check again for ``hold_s``. ``since``: the fault's end (``time.monotonic()``).
        ``history``: more prompts whose blocks may be lost for good (the fault destroyed
        the frames that stored them): on those only a wrong route counts.
        Records the measure, prints it, and returns the convergence time; raises
        AssertionError if it took longer than ``bound_s`` or any later answer disagrees."""
        check = _Check(fleet, [*prompts, *history], len(prompts), tuple(dead))
        seconds, found = _first_agreement(check, since, bound_s)
        checked, later = _hold(check, hold_s) if seconds is not None else (0, [])
        after = later if seconds is not None else found
        row = Convergence(
            fault,
            seconds,
            bound_s,
            checked if seconds is not None else len(check.prompts),
            sum(m.credited - m.held for m in after if m.wrong_route),
            sum(m.held - m.credited for m in after if not m.wrong_route),
        )
        self.results.append(row)
        print(f"\n{fault}: {_seconds(seconds)} (bound {bound_s:g} s)")
        assert seconds is not None, f"{fault}: not converged within {bound_s} s: {found[:6]}"
        assert seconds <= bound_s, f"{fault}: converged in {seconds:.2f} s, past {bound_s} s"
        assert later == [], f"{fault}: answers disagree after convergence: {later[:6]}"
        return seconds

    @staticmethod
    def table(results: Sequence[Convergence]) -> list[str]:
        """The summary table's lines (one row per measure, in run order)."""
        head = ("fault", "converged", "bound", "answers checked", "wrong routes", "lost blocks")
        rows = [
            (
                r.fault,
                _seconds(r.seconds) + (" (late)" if (r.seconds or 0.0) > r.bound_s else ""),
                f"{r.bound_s:g} s",
                str(r.num_checked),
                str(r.num_wrong_routes),
                str(r.num_lost_blocks),
            )
            for r in results
        ]
        widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
        return [
            " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
            for row in [head, *rows]
        ]


@dataclass(frozen=True, slots=True)
class _Check:
    fleet: FaultFleet
    prompts: Sequence[str]
    num_exact: int
    """The first ``num_exact`` prompts must agree exactly; the rest (history) only must
    not credit a block a replica does not hold."""
    dead: tuple[str, ...]

    def mismatches(self) -> list[Mismatch]:
        found = self.fleet.mismatches(self.prompts, self.dead)
        return [m for m in found if m.prompt < self.num_exact or m.wrong_route]


def _first_agreement(
    check: _Check, since: float, bound_s: float
) -> tuple[float | None, list[Mismatch]]:
    """(seconds from ``since`` to the end of the first check that found full agreement,
    or None if none had by ``bound_s``; the last mismatches). A check that begins within
    the bound and agrees is counted even if it ends past it (the caller then fails)."""
    while True:
        started = time.monotonic() - since
        found = check.mismatches()
        if not found:
            return time.monotonic() - since, []
        if started > bound_s:
            return None, found
        time.sleep(POLL_S)


def _hold(check: _Check, hold_s: float) -> tuple[int, list[Mismatch]]:
    """Check every prompt again until ``hold_s`` has passed (at least once): (answers
    checked, every mismatch seen)."""
    deadline = time.monotonic() + hold_s
    checked, found = 0, []
    while True:
        found += check.mismatches()
        checked += len(check.prompts)
        if time.monotonic() >= deadline:
            return checked, found
        time.sleep(POLL_S)


def _seconds(value: float | None) -> str:
    return "not converged" if value is None else f"{value:.2f} s"
