"""Domain events: what the rest of kvindex sees of vLLM's KV-event stream (hashes as u64,
``medium`` folded into a :class:`Tier`). Frozen Structs: built per event on the hot path."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol, TypeAlias

import msgspec

EngineHash: TypeAlias = int

ExtraKeys: TypeAlias = tuple[object, ...] | None


class Tier(enum.IntEnum):
    """Where a cached block lives. Values are stable: they are stored in Redis."""

    GPU = 0
    CPU = 1
    OTHER = 2

    @classmethod
    def from_medium(cls, medium: str | None) -> Tier:
        if medium is None:
            return cls.GPU
        folded = medium.casefold()
        if folded == "gpu":
            return cls.GPU
        if folded == "cpu":
            return cls.CPU
        return cls.OTHER


class StreamId(msgspec.Struct, frozen=True, order=True, gc=False):
    """One ordered event stream: a replica's data-parallel rank (each has its own seq)."""

    replica: str
    rank: int = 0

    def __str__(self) -> str:
        return f"{self.replica}/{self.rank}"

    @classmethod
    def parse(cls, text: str) -> StreamId:
        replica, sep, rank = text.rpartition("/")
        if not sep:
            return cls(text, 0)
        return cls(replica, int(rank))


class BlockStored(msgspec.Struct, frozen=True, gc=False):
    """Blocks newly cached on one tier, in chain order; ``len(block_hashes) * block_size``
    tokens, except CPU-offload placeholders (no tokens, block size 0)."""

    block_hashes: Sequence[EngineHash]
    parent_hash: EngineHash | None
    token_ids: Sequence[int]
    block_size: int
    tier: Tier
    lora_name: str | None = None
    extra_keys: Sequence[ExtraKeys] | None = None
    group_idx: int | None = None

    @property
    def is_placeholder(self) -> bool:
        return self.block_size == 0 and len(self.token_ids) == 0


class BlockRemoved(msgspec.Struct, frozen=True, gc=False):
    block_hashes: Sequence[EngineHash]
    tier: Tier
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False):
    """The replica's whole prefix cache was reset (every tier)."""


Event: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True, gc=False):
    seq: int
    ts: float
    rank: int
    events: Sequence[Event]
    num_bad_events: int = 0


class Numbered(Protocol):
    """What ordering needs of a batch: an :class:`EventBatch` or a ``native.NativeBatch``."""

    @property
    def seq(self) -> int: ...

    @property
    def ts(self) -> float: ...


class Topic(msgspec.Struct, frozen=True, gc=False):
    """llm-d's topic convention ``kv@<replica>@<model>``; anything else is an opaque name."""

    raw: str
    replica: str | None = None
    model: str | None = None

    @classmethod
    def parse(cls, raw: str) -> Topic:
        parts = raw.split("@")
        if len(parts) == 3 and parts[0] == "kv" and parts[1]:
            return cls(raw, parts[1], parts[2] or None)
        return cls(raw)
