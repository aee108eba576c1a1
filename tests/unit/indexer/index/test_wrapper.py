"""kvindex.indexer.index.wrapper: every call of the Protocol reaches the inner index unchanged,
and the holder lookup is the inner index's own when it has one."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import (
    APPLIED,
    ApplyResult,
    BatchOps,
    BlockIndex,
    HeldRuns,
    Op,
    OpKind,
    PrefixMatch,
    StoreIdentity,
    StreamStats,
)
from kvindex.indexer.index.wrapper import IndexWrapper

S = StreamId("r1")
GPU_MATCH = PrefixMatch((Tier.GPU,))
PROTOCOL_METHODS = sorted(
    name
    for name in vars(BlockIndex)
    if not name.startswith("_") and callable(vars(BlockIndex)[name])
)


class Recorder:
    """A BlockIndex (without a holder lookup) that records each call and its arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[object, ...]]] = []

    def apply(self, stream: StreamId, seq: int, ts: float, ops: Sequence[Op]) -> ApplyResult:
        self.calls.append(("apply", (stream, seq, ts, ops)))
        return APPLIED

    def apply_many(self, stream: StreamId, batches: Sequence[BatchOps]) -> list[ApplyResult]:
        self.calls.append(("apply_many", (stream, batches)))
        return [APPLIED]

    def resolve(self, stream: StreamId, engine_hashes: Sequence[int]) -> list[int | None]:
        self.calls.append(("resolve", (stream, engine_hashes)))
        return [None]

    def clear(self, stream: StreamId) -> None:
        self.calls.append(("clear", (stream,)))

    def drop(self, stream: StreamId) -> None:
        self.calls.append(("drop", (stream,)))

    def streams(self) -> list[StreamId]:
        self.calls.append(("streams", ()))
        return [S]

    def longest_prefix(
        self, keys: Sequence[int], streams: Iterable[StreamId]
    ) -> dict[StreamId, PrefixMatch]:
        asked = list(streams)
        self.calls.append(("longest_prefix", (keys, asked)))
        return {stream: GPU_MATCH for stream in asked}

    def stats(self, stream: StreamId) -> StreamStats:
        self.calls.append(("stats", (stream,)))
        return StreamStats(stream, 3, None)

    def close(self) -> None:
        self.calls.append(("close", ()))


CALLS: list[tuple[str, tuple[object, ...], object]] = [
    ("apply", (S, 1, 2.0, [(OpKind.CLEAR, Tier.GPU, 0, 0)]), APPLIED),
    ("apply_many", (S, [(1, 2.0, [])]), [APPLIED]),
    ("resolve", (S, [7]), [None]),
    ("clear", (S,), None),
    ("drop", (S,), None),
    ("streams", (), [S]),
    ("longest_prefix", ([5], [S]), {S: GPU_MATCH}),
    ("stats", (S,), StreamStats(S, 3, None)),
    ("close", (), None),
]
"""One call of each Protocol method, and what the :class:`Recorder` answers to it."""


def test_the_wrapper_defines_every_method_of_the_protocol_and_each_is_tested() -> None:
    assert [name for name in PROTOCOL_METHODS if name not in vars(IndexWrapper)] == []
    assert sorted(method for method, _, _ in CALLS) == PROTOCOL_METHODS


@pytest.mark.parametrize(("method", "args", "answer"), CALLS)
def test_each_call_reaches_the_inner_index_unchanged(
    method: str, args: tuple[object, ...], answer: object
) -> None:
    inner = Recorder()
    assert getattr(IndexWrapper(inner), method)(*args) == answer
    assert inner.calls == [(method, args)]


def test_holders_come_from_longest_prefix_when_the_inner_index_has_no_lookup() -> None:
    inner = Recorder()
    runs: HeldRuns = IndexWrapper(inner).holders([5], [S])
    assert runs == [(GPU_MATCH, [0])]
    assert inner.calls == [("longest_prefix", ([5], [S]))]


def test_holders_use_the_inner_index_s_own_lookup() -> None:
    inner = MemoryIndex()
    inner.apply(S, 0, 0.0, [(OpKind.STORE, Tier.GPU, 11, 5)])
    assert IndexWrapper(inner).holders([5], [S]) == inner.holders([5], [S])


def test_intact_asks_an_inner_index_that_can_tell() -> None:
    class Lost(MemoryIndex):
        def intact(self) -> bool:
            return False

    assert IndexWrapper(Lost()).intact() is False
    assert IndexWrapper(MemoryIndex()).intact() is True


def test_intact_is_true_when_the_inner_index_cannot_tell() -> None:
    inner = Recorder()
    assert isinstance(IndexWrapper(inner), StoreIdentity)
    assert IndexWrapper(inner).intact() is True
    assert inner.calls == []
