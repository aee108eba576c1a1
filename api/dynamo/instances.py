"""Dynamo's ``instance_id`` and rank ↔ replica ids: a registered rank is replica ``dynamo-<id>``
(rank 0) or ``dynamo-<id>.dp<rank>``; any other replica is :func:`instance_of_name`, its streams
its ranks."""

from __future__ import annotations

import re
from typing import NamedTuple

import xxhash

from kvindex.indexer.domain.events import StreamId

PREFIX = "dynamo-"
_REGISTERED = re.compile(r"dynamo-(0|[1-9][0-9]{0,19})(?:\.dp([1-9][0-9]{0,3}))?")
_NAME_BITS = (1 << 53) - 1  # exact in a JSON double
_SEED = b"kvindex/dynamo-instance\x00"


class Rank(NamedTuple):
    """Where a stream sits in Dynamo's terms."""

    instance_id: int
    dp_rank: int


def replica_id(instance_id: int, dp_rank: int) -> str:
    """The kvindex replica of one registered rank."""
    return f"{PREFIX}{instance_id}" if dp_rank == 0 else f"{PREFIX}{instance_id}.dp{dp_rank}"


def registered(replica: str) -> Rank | None:
    """The (instance, rank) a replica was registered as; None if not."""
    found = _REGISTERED.fullmatch(replica)
    if found is None or int(found.group(1)) >= 1 << 64:
        return None
    return Rank(int(found.group(1)), int(found.group(2) or 0))


def instance_of_name(replica: str) -> int:
    """53 bits of XXH3-64 over the id: stable across processes, exact in a JSON double."""
    return xxhash.xxh3_64_intdigest(_SEED + replica.encode()) & _NAME_BITS


def rank_of(stream: StreamId) -> Rank:
    """A stream's instance and rank, by either rule."""
    named = registered(stream.replica)
    if named is not None:
        return Rank(named.instance_id, named.dp_rank + stream.rank)
    return Rank(instance_of_name(stream.replica), stream.rank)
