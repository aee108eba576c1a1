"""The bodies of Dynamo's standalone-indexer API, as its 1.6.1 release reads and writes them."""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvindex.api.schemas import MAX_BLOCK_KEYS, MAX_TOKEN_IDS
from kvindex.api.tokenize.protocol import TokenId
from kvindex.indexer.fleet.replica import MAX_DP_SIZE

InstanceId = Annotated[int, msgspec.Meta(ge=0)]  # a u64, checked: msgspec's bounds stop at i64
DpRank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_DP_SIZE)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
BlockHash = Annotated[int, msgspec.Meta(ge=-(2**63))]  # i64 as Dynamo sends, or u64: same bits


class RegisterRequest(msgspec.Struct, kw_only=True):
    instance_id: InstanceId
    endpoint: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    model_name: Name
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    dp_rank: DpRank = 0
    routing_group: Name | None = None

    def __post_init__(self) -> None:
        _check_u64("instance_id", self.instance_id)


class UnregisterRequest(msgspec.Struct, kw_only=True):
    instance_id: InstanceId
    model_name: Name
    dp_rank: DpRank | None = None
    routing_group: Name | None = None

    def __post_init__(self) -> None:
        _check_u64("instance_id", self.instance_id)


class QueryRequest(msgspec.Struct, kw_only=True):
    token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOKEN_IDS)]
    model_name: Name
    lora_name: Name | None = None
    routing_group: Name | None = None


class QueryByHashRequest(msgspec.Struct, kw_only=True):
    block_hashes: Annotated[
        list[BlockHash], msgspec.Meta(max_length=MAX_BLOCK_KEYS)
    ]  # kvindex keys
    model_name: Name
    lora_name: Name | None = None
    routing_group: Name | None = None

    def __post_init__(self) -> None:
        if any(h >= _U64_END for h in self.block_hashes):
            raise ValueError("block_hashes: each must fit in 64 bits")


class Listener(msgspec.Struct):
    endpoint: str | None
    status: str


class Worker(msgspec.Struct):
    instance_id: int
    source: str
    status: str
    model_name: str
    routing_group: str
    block_size: int
    endpoints: dict[str, str | None]
    listeners: dict[str, Listener]


class InstanceOverlap(msgspec.Struct):
    """Matched tokens of one instance: the longest on any tier, on GPU, on GPU or CPU, on any
    tier (``disk``), and on GPU per rank holding a match on any tier (``dp``)."""

    longest_matched: int
    gpu: int
    dp: dict[str, int]
    cpu: int
    disk: int


class Overlap(msgspec.Struct):
    scores: dict[str, dict[str, int]]
    frequencies: list[int]
    instances: dict[str, InstanceOverlap]


class DynamoStatus(msgspec.Struct):
    status: str


class DynamoError(msgspec.Struct):
    error: str


_U64_END = 1 << 64


def _check_u64(name: str, value: int) -> None:
    if value >= _U64_END:
        raise ValueError(f"{name} must be below 2**64, got {value}")
