"""One replica's load at one instant, and the rule that says which of two loads a store keeps.

Every :class:`Load` is valid (checked on construction and on decode); every invalid load or
load that could not be obtained is a :class:`LoadError`, whichever module of
:mod:`kvindex.api.load` raises it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import msgspec

from kvindex.indexer.domain.errors import KvIndexError

SOURCES = ("push", "scrape")
"""Allowed values of :attr:`Load.source`."""
MAX_FUTURE_S = 60.0
"""How far past the receiver's clock a reported ``ts`` may be (clock skew between hosts);
a load stamped later would otherwise win over every real one until that time."""


class LoadError(KvIndexError):
    """A load that is invalid (the message names the field) or could not be obtained."""


class Load(msgspec.Struct, frozen=True):
    """One replica's load at one instant. Always valid: checked on construction and decode.

    Raises :class:`LoadError` naming the field when a count or ``ts`` is negative, the
    usage is outside [0, 1], any number is not finite, or ``source`` is not one of
    :data:`SOURCES`.
    """

    running: float
    """Requests being processed (summed over data-parallel engines)."""
    waiting: float
    """Requests queued (summed over data-parallel engines)."""
    kv_usage: float
    """Fraction of KV-cache blocks in use, 0..1 (the busiest engine's)."""
    ts: float
    """When it was measured, unix seconds (the measurer's wall clock)."""
    source: str
    """``"push"`` (``POST /load``) or ``"scrape"`` (:class:`MetricsScraper`)."""

    def __post_init__(self) -> None:
        self.validated()

    def validated(self, *, now: float | None = None) -> Load:
        """``self`` once checked (construction already checks; this states it at call sites).

        With ``now`` (the receiver's clock), also raises :class:`LoadError` naming ``ts`` when
        it is more than :data:`MAX_FUTURE_S` ahead of it.
        """
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
    """The store rule: ``new`` replaces ``old`` unless ``old`` was measured strictly later.

    At equal timestamps the later write wins (a repeated put is idempotent).
    """
    return old is None or new.ts >= old.ts


class InFlight(NamedTuple):
    """Requests in flight to one replica, as the proxies that sent them reserved them
    (:mod:`~kvindex.api.load.reservations`), summed over every live lease."""

    num_requests: int
    num_tokens: int
    """Their uncached prompt tokens: each request's prompt minus what the replica had
    cached when it was chosen (the prefill work sent to it)."""


NO_IN_FLIGHT = InFlight(0, 0)


class CountedLoad(NamedTuple):
    """A replica's stored load (None: none stored yet), the answers that chose it since
    it was stored, and the requests in flight to it (reserved by proxies)."""

    load: Load | None
    routed: int
    in_flight: InFlight = NO_IN_FLIGHT
