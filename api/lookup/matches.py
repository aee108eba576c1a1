"""Each candidate's streams, and the index's holders of a prompt resolved to each replica's
best match (the longest over its ranks; a tie: the lowest rank); an index outage is a
``degraded`` lookup with no matches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.protocol import HeldRuns, IndexUnavailableError, PrefixMatch
from kvindex.indexer.native import _lookup

Matches = dict[str, PrefixMatch]
Streams = tuple[StreamId, ...]


@dataclass(frozen=True, slots=True)
class RankedStreams:
    """Every stream of a ranked candidate list, sorted; the ``*_of`` lists are by stream index
    (``position_of``: its replica's index in the ranked list, as ``position``)."""

    streams: Streams
    position: dict[str, int]
    streams_of: dict[str, Streams]
    replica_of: list[str]
    rank_of: list[int]
    position_of: list[int]
    unique: bool
    """No replica has two streams: each holder is its replica's best."""


def ranked_streams(
    replicas: Sequence[str], specs: Sequence[ReplicaSpec], heard: Sequence[StreamId]
) -> RankedStreams:
    wanted = set(replicas)
    streams = {StreamId(r.id, rank) for r in specs if r.id in wanted for rank in range(r.dp_size)}
    streams.update(s for s in heard if s.replica in wanted)
    ordered = tuple(sorted(streams))
    streams_of: dict[str, list[StreamId]] = {}
    for stream in ordered:
        streams_of.setdefault(stream.replica, []).append(stream)
    position = {r: i for i, r in enumerate(replicas)}
    by_replica = {r: tuple(s) for r, s in streams_of.items()}
    replica_of, rank_of = [s.replica for s in ordered], [s.rank for s in ordered]
    position_of = [position[r] for r in replica_of]
    unique = len(ordered) == len(by_replica)
    return RankedStreams(ordered, position, by_replica, replica_of, rank_of, position_of, unique)


@dataclass(slots=True)
class Lookup:
    """The index's holders, and once resolved, each replica's best match and its rank."""

    runs: HeldRuns = field(default_factory=list)
    matches: Matches = field(default_factory=dict)
    ranks: dict[str, int] = field(default_factory=dict)
    """The rank of a replica's best match when it is not 0."""
    degraded: str | None = None

    @classmethod
    def of(cls, found: HeldRuns | IndexUnavailableError) -> Lookup:
        if isinstance(found, IndexUnavailableError):
            return cls(degraded=f"index store unavailable: {found}")
        return cls(found)

    def num_matched(self) -> int:
        return len(self.matches)

    def resolve(self, streams: RankedStreams) -> None:
        """Each replica's best match from the runs, in one compiled pass."""
        if self.runs:
            self.matches, self.ranks = _best_matches(
                self.runs, streams.replica_of, streams.rank_of, streams.unique
            )


_best_matches = _lookup.best_matches
