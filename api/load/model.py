"""One replica's load at one instant (always valid), and which of two loads a store keeps."""

from __future__ import annotations

import math
from typing import NamedTuple

import msgspec

from kvindex.indexer.domain.errors import KvIndexError

SOURCES = ("push", "scrape")
MAX_FUTURE_S = 60.0
"""How far past the receiver's clock a reported ``ts`` may be (clock skew between hosts)."""


class LoadError(KvIndexError):
    """A load that is invalid (the message names the field) or could not be obtained."""


class Load(msgspec.Struct, frozen=True):
    """Requests running and waiting (summed over data-parallel engines), the busiest engine's
    KV usage (0..1), when measured (unix s), how; checked on construction and decode."""

    running: float
    waiting: float
    kv_usage: float
    ts: float
    source: str

    def __post_init__(self) -> None:
        self.validated()

    def validated(self, *, now: float | None = None) -> Load:
        """``self`` once checked; with ``now``, ``ts`` at most :data:`MAX_FUTURE_S` ahead of it."""
        for name in ("running", "waiting", "ts"):
            _check_number(name, getattr(self, name), high=math.inf)
        if now is not None and self.ts > now + MAX_FUTURE_S:
            raise LoadError(
                f"ts must be at most {MAX_FUTURE_S:g} s ahead of now ({now:.0f}), got {self.ts!r}"
            )
        _check_number("kv_usage", self.kv_usage, high=1.0)
        if self.source not in SOURCES:
            raise LoadError(f"source must be one of {SOURCES}, got {self.source!r}")
        return self

    def age_s(self, now: float) -> float:
        """Seconds since it was measured; 0 for a load stamped in the future (clock skew)."""
        return max(0.0, now - self.ts)


def _check_number(name: str, value: object, *, high: float) -> None:
    # bool is an int: reject it explicitly, it is never a measurement.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LoadError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or not 0.0 <= value <= high:
        bounds = "in [0, 1]" if high == 1.0 else ">= 0"
        raise LoadError(f"{name} must be a finite number {bounds}, got {value!r}")


def is_newer_or_same(new: Load, old: Load | None) -> bool:
    """The store rule: ``new`` replaces ``old`` unless ``old`` was measured strictly later."""
    return old is None or new.ts >= old.ts


class InFlight(NamedTuple):
    """Requests in flight to one replica, summed over every live lease."""

    num_requests: int
    num_tokens: int
    """Their prompt tokens the replica had not cached when chosen (prefill sent to it)."""


NO_IN_FLIGHT = InFlight(0, 0)


class CountedLoad(NamedTuple):
    """A stored load (None: none yet), the answers that chose it since, the requests in flight."""

    load: Load | None
    routed: int
    in_flight: InFlight = NO_IN_FLIGHT
