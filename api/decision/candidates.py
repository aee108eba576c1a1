"""What one answer read (matches, loads, stream freshness, one clock reading), and each
replica as a policy sees it (:class:`~kvindex.api.decision.policies.Candidate`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvindex.api.decision.policies import Candidate, LoadInput
from kvindex.api.load.model import CountedLoad
from kvindex.api.lookup.matches import Lookup
from kvindex.indexer.fleet.registry import Freshness, StreamFreshness
from kvindex.indexer.index.protocol import NO_MATCH


@dataclass(frozen=True, slots=True)
class Seen:
    """One answer's reads; a :class:`Candidate` is made of them per replica ranked."""

    lookup: Lookup
    loads: dict[str, CountedLoad]
    statuses: dict[str, list[StreamFreshness]]
    now: float
    version: int | None = None
    """The load store's change version before the loads were read (None: not the store's)."""

    def state(self, replica: str) -> Freshness:
        statuses = self.statuses.get(replica, ())
        return statuses[0].freshness if len(statuses) == 1 else freshness(statuses)

    def candidate(self, replica: str) -> Candidate:
        state = self.state(replica)
        tiers = self.lookup.matches.get(replica, NO_MATCH).tiers
        counted = self.loads.get(replica)
        if counted is None:
            return Candidate(replica, tiers, state, None)
        load, routed, in_flight = counted
        load_input = None
        if load is not None:
            age = max(0.0, self.now - load.ts)  # Load.age_s, inlined
            load_input = LoadInput(load.running, load.waiting, load.kv_usage, age, routed)
        num_requests, num_tokens = in_flight
        return Candidate(replica, tiers, state, load_input, num_requests, num_tokens)


_WORST = {Freshness.LIVE: 0, Freshness.PARTIAL: 1, Freshness.REPLAYING: 2, Freshness.STALE: 3}


def freshness(statuses: Sequence[StreamFreshness]) -> Freshness:
    """A replica is as fresh as its least fresh stream; never heard of counts as stale."""
    if not statuses:
        return Freshness.STALE
    return max((s.freshness for s in statuses), key=_WORST.__getitem__)


def states(statuses: Sequence[StreamFreshness]) -> dict[str, Freshness]:
    out: dict[str, Freshness] = {}
    worst, rank = out.get, _WORST.__getitem__
    for status in statuses:
        replica, state = status.stream.replica, status.freshness
        known = worst(replica)
        if known is None or rank(state) > rank(known):
            out[replica] = state
    return out


def by_replica(statuses: Sequence[StreamFreshness]) -> dict[str, list[StreamFreshness]]:
    out: dict[str, list[StreamFreshness]] = {}
    for status in statuses:
        out.setdefault(status.stream.replica, []).append(status)
    return out
