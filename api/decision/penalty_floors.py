"""Floors under the load penalties, kept per change of the loads, so that an answer over many
candidates computes few exact penalties; the result equals computing them all (the compiled
loops in ``_lookup`` do the work; without them :func:`pays` is False)."""

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
try:
    from kvindex.indexer.native import _lookup
except ImportError:
    pass
else:
    _compiled_floors, _compiled_ascending = _lookup.penalty_floors, _lookup.ascending
    _compiled_within = _lookup.penalties_within
    _compiled_penalties = _lookup.load_penalties

WINDOW_OF_HALF_LIFE = 1 / 16
"""How far ahead floors hold, in half-lives (a floor is then within ``1 - 0.5 ** (1/16)``)."""
MIN_CANDIDATES = 128
"""Fewer candidates than this: every penalty is computed (``bench/score.py`` measures both)."""
MAX_CHANGED = 256
"""Changed replicas (an eighth of the candidates if fewer) before floors are made again."""


def available() -> bool:
    return _compiled_within is not None


def pays(num_candidates: int, top_k: int | None) -> bool:
    """Floors pay: compiled loops, :data:`MIN_CANDIDATES` or more, a ``top_k`` leaving some out."""
    return (
        _compiled_within is not None
        and num_candidates >= MIN_CANDIDATES
        and top_k is not None
        and 0 < top_k < num_candidates
    )


class PenaltyFloors:
    """Floors under the penalties of ``replicas`` from a load read at store ``version``, holding
    until ``until``; changed floors are remade (:meth:`note_changed`). Not thread-safe."""

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
        self._order = _compiled_ascending(self._floors)
        self._ordered = [self._floors[i] for i in self._order]

    def holds(self, replicas: list[str], now: float) -> bool:
        same = self.replicas is replicas or self.replicas == replicas
        return same and now <= self.until

    def note_changed(
        self,
        changed: Sequence[str],
        position: dict[str, int],
        counted: dict[str, CountedLoad],
        version: int,
    ) -> bool:
        """Remake the ``changed`` replicas' floors from ``counted`` (read at ``version``);
        False, nothing changed, when so many changed that all floors should be made again."""
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
        """The exact penalties at ``now`` of every replica that can be among the ``k`` lowest."""
        assert _compiled_within is not None
        penalties, positions, kth = _compiled_within(
            self.replicas, counted, now, self._order, self._floors, [], k, *self._args
        )
        return Walk(self, counted, now, penalties=penalties, positions=positions, kth=kth)


class Walk:
    """One answer's ``penalties`` by position (``inf`` where not computed), the ``positions``
    computed, and ``kth``, the ``k``-th lowest penalty of all."""

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
        """A floor under every penalty, by position (the floors' own list: not to be changed)."""
        return self._floors._floors

    def complete(self, wanted: Iterable[int]) -> None:
        """Compute the exact penalties of the positions ``wanted`` not computed yet."""
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
