"""Each candidate's streams, and the index's holders of a prompt resolved to each replica's
best match (the longest over its ranks; a tie: the lowest rank)."""

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
    """Every stream of a ranked candidate list, sorted, with the indices the compiled loops
    read; made once per candidate list and fleet (:func:`ranked_streams`)."""

    streams: Streams
    position: dict[str, int]
    """Each candidate's index in the ranked list."""
    streams_of: dict[str, Streams]
    """Each candidate's streams (declared ranks and ranks heard of)."""
    replica_of: list[str]
    """Each stream's replica, by its index in ``streams``."""
    rank_of: list[int]
    """Each stream's rank, by its index in ``streams``."""
    position_of: list[int]
    """Each stream's replica's index in the ranked list, by the stream's index."""
    unique: bool
    """No replica has two streams (data parallelism): each holder is its replica's best."""


def ranked_streams(
    replicas: Sequence[str], specs: Sequence[ReplicaSpec], heard: Sequence[StreamId]
) -> RankedStreams:
    """Every rank of every replica in ``replicas`` (declared or heard of), sorted."""
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
    """What the index answered (its holders, by index in the streams asked); once
    resolved (:meth:`resolve`), each replica's best match and the rank holding it."""

    runs: HeldRuns = field(default_factory=list)
    matches: Matches = field(default_factory=dict)
    """Replicas holding at least the first block, with their best match."""
    ranks: dict[str, int] = field(default_factory=dict)
    """The rank of a replica's best match when it is not 0 (absent: rank 0)."""
    degraded: str | None = None

    @classmethod
    def of(cls, found: HeldRuns | IndexUnavailableError) -> Lookup:
        """The index's holders, or its outage as ``degraded``."""
        if isinstance(found, IndexUnavailableError):
            return cls(degraded=f"index store unavailable: {found}")
        return cls(found)

    def num_matched(self) -> int:
        return len(self.matches)

    def resolve(self, streams: RankedStreams) -> None:
        """Each replica's best match from the runs (indices into ``streams.streams``), in
        one compiled pass (``_lookup.best_matches``)."""
        if self.runs:
            self.matches, self.ranks = _best_matches(
                self.runs, streams.replica_of, streams.rank_of, streams.unique
            )


_best_matches = _lookup.best_matches
