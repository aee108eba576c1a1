"""The stream → ingest worker map and the workers' summed unrouted totals."""

from __future__ import annotations

import threading

import pytest

from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.domain.health import UnroutedCounters
from kvindex.indexer.ingest.partition import StreamPartition, UnroutedTotals


def test_streams_are_shared_out_evenly_and_keep_their_worker() -> None:
    partition = StreamPartition(2)
    streams = [StreamId(f"r{i}", rank) for i in range(8) for rank in range(2)]
    first = [partition.worker_of(s) for s in streams]
    assert partition.num_streams() == [8, 8]
    assert [partition.worker_of(s) for s in reversed(streams)] == first[::-1]
    assert partition.num_streams() == [8, 8]  # asking again gives nothing new
    assert first[:4] == [0, 1, 0, 1]  # the fewest first, the lowest on a tie


def test_one_worker_owns_everything_and_keeps_no_map() -> None:
    partition = StreamPartition(1)
    assert {partition.worker_of(StreamId(f"r{i}")) for i in range(5)} == {0}
    assert partition.num_streams() == [0]
    with pytest.raises(ValueError, match="num_workers"):
        StreamPartition(0)


def test_workers_asking_at_once_agree_on_every_stream() -> None:
    partition = StreamPartition(3)
    streams = [StreamId(f"r{i}") for i in range(300)]
    answers: list[list[int]] = [[] for _ in range(4)]
    barrier = threading.Barrier(4)

    def ask(out: list[int]) -> None:
        barrier.wait()
        out.extend(partition.worker_of(s) for s in streams)

    threads = [threading.Thread(target=ask, args=(out,)) for out in answers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers[0] == answers[1] == answers[2] == answers[3]
    assert partition.num_streams() == [100, 100, 100]


class _Sink:
    def __init__(self) -> None:
        self.recorded: list[UnroutedCounters] = []

    def record_unrouted(self, totals: UnroutedCounters) -> None:
        self.recorded.append(totals)


def test_the_registry_gets_the_sum_of_every_workers_totals() -> None:
    sink = _Sink()
    totals = UnroutedTotals(sink, 2)
    first, second = totals.publisher(0), totals.publisher(1)
    mine = UnroutedCounters(num_undecodable=2, num_refused=1)
    first(mine)
    mine.num_undecodable = 5  # the pipeline's running totals: a copy was kept
    second(UnroutedCounters(num_unidentified=3, num_refused=1))
    assert sink.recorded[-1] == UnroutedCounters(2, 3, 2)
    first(UnroutedCounters(num_undecodable=4, num_refused=1))
    assert sink.recorded[-1] == UnroutedCounters(4, 3, 2)
