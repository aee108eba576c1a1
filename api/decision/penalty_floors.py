"""Load penalties kept per change of the loads, so that an answer computes few of them."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence

from kvindex.api.decision.policies import Weights, penalty_weights
from kvindex.api.load.model import CountedLoad

_Floors = Callable[..., list[float]]  # as _lookup.penalty_floors
_Within = Callable[..., tuple[list[float], list[int], float]]  # as _lookup.penalties_within
_compiled_floors: _Floors | None = None
_compiled_ascending: Callable[[list[float]], list[int]] | None = None
_compiled_within: _Within | None = None
_compiled_penalties: _Floors | None = None  # as _lookup.load_penalties
"""The compiled loops (None: not built; the scorer then computes every penalty)."""
try:
    from kvindex.indexer.native import _lookup
except ImportError:
    pass
else:
    _compiled_floors, _compiled_ascending = _lookup.penalty_floors, _lookup.ascending
    _compiled_within = _lookup.penalties_within
    _compiled_penalties = _lookup.load_penalties

WINDOW_OF_HALF_LIFE = 1 / 16
"""How far ahead floors hold, in half-lives: a decaying penalty's floor is then within
``1 - 0.5 ** (1 / 16)`` of it, so few replicas beyond the ``top_k`` are computed."""
MIN_CANDIDATES = 128
"""Fewer candidates than this: every penalty is computed (cheaper than keeping floors;
``bench/score.py`` measures both)."""
MAX_CHANGED = 256
"""Changed replicas (whose penalties are computed every answer) before floors are made
again; an eighth of the candidates when that is fewer."""


def available() -> bool:
    """The compiled loops are built (without them every penalty is computed)."""
    return _compiled_within is not None


def pays(num_candidates: int, top_k: int | None) -> bool:
    """Whether floors pay for an answer explaining ``top_k`` of ``num_candidates``: the
    compiled loops are built, the candidates are :data:`MIN_CANDIDATES` or more, and the
    ``top_k`` leaves some out."""
    return (
        _compiled_within is not None
        and num_candidates >= MIN_CANDIDATES
        and top_k is not None
        and 0 < top_k < num_candidates
    )


class PenaltyFloors:
    """Floors under the load penalties of ``replicas`` (the scorer's ranked list, never
    changed) under ``weights``, made from a load read at store version ``version`` (see
    :class:`~kvindex.api.load.store.LoadChanges`) and holding until ``until``; a changed
    replica's floor is made again and moved in the order (:meth:`note_changed`)."""

    __slots__ = ("_args", "_floors", "_order", "_ordered", "replicas", "until", "version")

    def __init__(
        self,
        replicas: list[str],
        weights: Weights,
        counted: dict[str, CountedLoad],
        *,
        now: float,
        version: int,
    ) -> None:
        assert _compiled_floors is not None and _compiled_ascending is not None
        half_life = weights.load_half_life_s
        self.replicas = replicas
        self.until = now + half_life * WINDOW_OF_HALF_LIFE if half_life else math.inf
        self.version = version
        self._args = penalty_weights(weights)
        self._floors = _compiled_floors(replicas, counted, self.until, *self._args)
        """Each replica's floor, by position."""
        self._order = _compiled_ascending(self._floors)
        """The positions in ascending order of floor."""
        self._ordered = [self._floors[i] for i in self._order]
        """The floors in that order (what a changed floor is found and placed by)."""

    def holds(self, replicas: list[str], now: float) -> bool:
        """The floors are for ``replicas`` and hold at ``now``."""
        same = self.replicas is replicas or self.replicas == replicas
        return same and now <= self.until

    def note_changed(
        self,
        changed: Sequence[str],
        position: dict[str, int],
        counted: dict[str, CountedLoad],
        version: int,
    ) -> bool:
        """Make the floors of the replicas whose load changed again from ``counted`` (the
        store's ``changed_since`` the floors' version, read after ``counted`` was, which the
        store's version was ``version`` before) and move them in the order; False, and
        nothing changed, when so many changed that the floors should be made again."""
        assert _compiled_floors is not None
        moved = [at for replica in changed if (at := position.get(replica)) is not None]
        if len(moved) > min(MAX_CHANGED, len(self.replicas) // 8 + 1):
            return False
        if moved:
            replicas = self.replicas
            fresh = _compiled_floors(
                [replicas[at] for at in moved], counted, self.until, *self._args
            )
            for at, floor in zip(moved, fresh, strict=True):
                self._move(at, floor)
        self.version = version
        return True

    def _move(self, at: int, floor: float) -> None:
        floors, order, ordered = self._floors, self._order, self._ordered
        old = floors[at]
        if old == floor:
            return
        i = bisect.bisect_left(ordered, old)
        while order[i] != at:  # among equal floors
            i += 1
        del order[i], ordered[i]
        j = bisect.bisect_left(ordered, floor)
        order.insert(j, at)
        ordered.insert(j, floor)
        floors[at] = floor

    def walk(self, counted: dict[str, CountedLoad], now: float, k: int) -> Walk:
        """The exact penalties, as of ``now``, of every replica that can be among the ``k``
        lowest (``1 <= k <= len(replicas)``): see :class:`Walk`."""
        assert _compiled_within is not None
        penalties, positions, kth = _compiled_within(
            self.replicas, counted, now, self._order, self._floors, [], k, *self._args
        )
        return Walk(self, counted, now, penalties=penalties, positions=positions, kth=kth)


class Walk:
    """One answer's penalties from :class:`PenaltyFloors`: ``penalties`` by position (exact
    where computed, ``inf`` elsewhere), ``positions`` computed, and ``kth``, the ``k``-th
    lowest penalty of all; :meth:`complete` adds the holders the scorer needs."""

    __slots__ = ("_counted", "_floors", "_now", "kth", "penalties", "positions")

    def __init__(
        self,
        floors: PenaltyFloors,
        counted: dict[str, CountedLoad],
        now: float,
        *,
        penalties: list[float],
        positions: list[int],
        kth: float,
    ) -> None:
        self._floors, self._counted, self._now = floors, counted, now
        self.penalties, self.positions, self.kth = penalties, positions, kth

    def bounds(self) -> list[float]:
        """A floor under every penalty, by position (the floors' own list, not to be
        changed: a copy would touch every replica's float, a cache line each)."""
        return self._floors._floors

    def complete(self, wanted: Iterable[int]) -> None:
        """Compute the exact penalties of the positions ``wanted`` not computed yet (the
        holders that may rank among the ``top_k``, found from :meth:`bounds`)."""
        assert _compiled_penalties is not None
        penalties, inf = self.penalties, math.inf
        missing = [at for at in wanted if penalties[at] == inf]
        if not missing:
            return
        floors = self._floors
        replicas = [floors.replicas[at] for at in missing]
        exact = _compiled_penalties(replicas, self._counted, self._now, *floors._args)
        for at, penalty in zip(missing, exact, strict=True):
            penalties[at] = penalty
        self.positions.extend(missing)
