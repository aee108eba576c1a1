"""kvindex.indexer.index.circuit: the store circuit's states on a hand-moved clock, and the index
wrapper skipping a store that is down without calling it."""

from __future__ import annotations

import pytest

from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.index.circuit import CircuitIndex, StoreCircuit, StoreSkippedError
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import IndexUnavailableError, OpKind, PrefixMatch
from tests.support.clock import Clock

COOLDOWN_S = 0.5


class Store:
    """A store call that fails while ``down``, counting the calls that reached it."""

    def __init__(self) -> None:
        self.down = False
        self.num_calls = 0

    def read(self) -> str:
        self.num_calls += 1
        if self.down:
            raise IndexUnavailableError("redis: connection refused")
        return "ok"


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def circuit(clock: Clock) -> StoreCircuit:
    return StoreCircuit(COOLDOWN_S, clock=clock)


def test_a_failure_opens_it_and_calls_are_skipped_without_reaching_the_store(
    circuit: StoreCircuit, clock: Clock
) -> None:
    store = Store()
    assert circuit.call(store.read) == "ok"
    store.down = True
    with pytest.raises(IndexUnavailableError):
        circuit.call(store.read)
    assert circuit.is_open
    clock.now += COOLDOWN_S / 2
    with pytest.raises(StoreSkippedError, match="connection refused"):
        circuit.call(store.read)
    assert (store.num_calls, circuit.num_skipped, circuit.num_openings) == (2, 1, 1)


def test_after_the_cooldown_one_call_probes_and_the_others_wait(
    circuit: StoreCircuit, clock: Clock
) -> None:
    store = Store()
    store.down = True
    with pytest.raises(IndexUnavailableError):
        circuit.call(store.read)
    clock.now += COOLDOWN_S
    with pytest.raises(IndexUnavailableError):
        circuit.call(store.read)  # the probe: reaches the store, still down
    with pytest.raises(StoreSkippedError):
        circuit.call(store.read)  # a new cooldown started with the probe
    clock.now += COOLDOWN_S
    store.down = False
    assert circuit.call(store.read) == "ok"
    assert not circuit.is_open
    assert circuit.call(store.read) == "ok"
    assert (store.num_calls, circuit.num_openings) == (4, 1)


def test_call_if_closed_never_probes(circuit: StoreCircuit, clock: Clock) -> None:
    store = Store()
    store.down = True
    with pytest.raises(IndexUnavailableError):
        circuit.call(store.read)
    clock.now += 10 * COOLDOWN_S
    with pytest.raises(StoreSkippedError):
        circuit.call_if_closed(store.read)
    store.down = False
    assert circuit.call(store.read) == "ok"
    assert circuit.call_if_closed(store.read) == "ok"


def test_an_error_that_is_not_an_outage_leaves_it_closed(circuit: StoreCircuit) -> None:
    def bad() -> None:
        raise ValueError("a bad argument, not a sick store")

    with pytest.raises(ValueError, match="bad argument"):
        circuit.call(bad)
    assert not circuit.is_open


class DownIndex(MemoryIndex):
    def __init__(self) -> None:
        super().__init__()
        self.num_lookups = 0

    def streams(self) -> list[StreamId]:
        self.num_lookups += 1
        raise IndexUnavailableError("redis: timeout")


def test_the_index_wrapper_skips_a_store_that_is_down(circuit: StoreCircuit) -> None:
    inner = DownIndex()
    index = CircuitIndex(inner, circuit)
    for _ in range(3):
        with pytest.raises(IndexUnavailableError):
            index.streams()
    assert inner.num_lookups == 1
    with pytest.raises(StoreSkippedError):
        index.stats(StreamId("r1"))  # one circuit: every call of the store is skipped


def test_the_index_wrapper_passes_calls_through_while_closed(circuit: StoreCircuit) -> None:
    index = CircuitIndex(MemoryIndex(), circuit)
    index.apply(StreamId("r1"), 0, 1.0, [])
    assert index.streams() == [StreamId("r1")]
    assert index.stats(StreamId("r1")).watermark == 0


def test_the_index_wrapper_asks_whether_the_store_kept_its_data_through_the_circuit(
    circuit: StoreCircuit,
) -> None:
    assert CircuitIndex(MemoryIndex(), circuit).intact()
    inner = DownIndex()
    index = CircuitIndex(inner, circuit)
    with pytest.raises(IndexUnavailableError):
        index.streams()  # opens the circuit
    with pytest.raises(StoreSkippedError):
        index.intact()  # the write path's once-a-second look does not wait on it either


def test_the_index_wrapper_passes_a_holders_lookup_through_the_circuit(
    circuit: StoreCircuit,
) -> None:
    inner = DownIndex()
    inner.apply(StreamId("r1"), 0, 1.0, [(OpKind.STORE, Tier.GPU, 1, 101)])
    index = CircuitIndex(inner, circuit)
    assert index.holders([101], [StreamId("r1")]) == [(PrefixMatch((Tier.GPU,)), [0])]
    with pytest.raises(IndexUnavailableError):
        index.streams()  # opens the circuit
    with pytest.raises(StoreSkippedError):
        index.holders([101], [StreamId("r1")])
