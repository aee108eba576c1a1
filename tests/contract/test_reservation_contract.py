"""The reservation contract (:mod:`kvindex.api.load.reservations`), run on every backend:
``memory`` (:class:`MemoryLedger`, on a clock the test moves), ``fakeredis``, ``redis`` and
``cluster`` (:class:`RedisLedger`, on the server's clock: the test waits the lease out; on
the cluster the load store's pipeline spans two slots, each script stays on one). Every ledger is
the one its load store owns, read the way ``/score`` reads it (``LoadStore.get_counted``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis

from kvindex.api.load.model import NO_IN_FLIGHT, CountedLoad, InFlight, Load
from kvindex.api.load.reservations import MemoryLedger, Reservations
from kvindex.api.load.store import LoadStore, MemoryLoadStore, RedisLoadStore
from kvindex.indexer.redis.schema import Schema
from tests.contract.conftest import BACKENDS, REDIS_BACKENDS, redis_store_client
from tests.support.redis_server import RedisServer

TTL_S = 1.0
"""Long enough that a loaded host (a step of the test stalled by a few hundred ms) cannot
lapse a lease the test means to be live: on Redis the lease runs on real time."""


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Backend:
    """One store, and how to let time pass on its ledger's clock."""

    store: LoadStore
    clock: FakeClock | None
    """The memory ledger's clock; None: Redis' own (real time)."""

    def holder(self, name: str, lost: list[int] | None = None) -> Reservations:
        on_lost = lost.append if lost is not None else (lambda _num: None)
        return Reservations(self.store.ledger, TTL_S, holder=name, on_lost=on_lost)

    def wait(self, seconds: float) -> None:
        if self.clock is not None:
            self.clock.now += seconds
        else:
            time.sleep(seconds)

    def in_flight(self, *replicas: str) -> dict[str, InFlight]:
        counted = self.store.get_counted(list(replicas))
        return {r: c.in_flight for r, c in counted.items() if c.in_flight.num_requests}


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    name: str = request.param
    clock: FakeClock | None = None
    store: LoadStore
    if name == "memory":
        clock = FakeClock()
        store = MemoryLoadStore(MemoryLedger(clock))
    else:
        store = RedisLoadStore(redis_store_client(name, request), Schema("test"))
    yield Backend(store, clock)
    store.close()


def test_a_reservation_counts_a_request_and_its_tokens(backend: Backend) -> None:
    proxy = backend.holder("p1")
    proxy.reserve("r1", 100)
    proxy.reserve("r1", 20)
    proxy.reserve("r2", 0)
    assert backend.in_flight("r1", "r2", "r3") == {"r1": InFlight(2, 120), "r2": InFlight(1, 0)}
    assert backend.store.ledger.in_flight(["r1", "r3"]) == {"r1": InFlight(2, 120)}
    assert proxy.num_held() == 3


def test_a_replica_with_requests_in_flight_and_no_load_is_read_without_one(
    backend: Backend,
) -> None:
    backend.holder("p1").reserve("r1", 7)
    loaded = Load(running=1.0, waiting=0.0, kv_usage=0.1, ts=100.0, source="push")
    backend.store.put("r2", loaded)
    assert backend.store.get_counted(["r1", "r2"]) == {
        "r1": CountedLoad(None, 0, InFlight(1, 7)),
        "r2": CountedLoad(loaded, 0, NO_IN_FLIGHT),
    }


def test_a_release_takes_it_off_once(backend: Backend) -> None:
    proxy = backend.holder("p1")
    first, second = proxy.reserve("r1", 10), proxy.reserve("r1", 5)
    assert proxy.release(first) is True
    assert backend.in_flight("r1") == {"r1": InFlight(1, 5)}
    assert proxy.release(first) is False  # twice: nothing more is taken off
    assert proxy.release(second) is True
    assert backend.in_flight("r1") == {}
    assert backend.store.get_counted(["r1"]) == {}  # no load, nothing in flight: absent


def test_holders_on_one_store_add_up_and_release_only_their_own(backend: Backend) -> None:
    one, two = backend.holder("p1"), backend.holder("p2")
    mine = one.reserve("r1", 10)
    theirs = two.reserve("r1", 30)
    assert backend.in_flight("r1") == {"r1": InFlight(2, 40)}
    assert backend.store.ledger.release("p2", mine.id) is False  # not p2's to release
    assert one.release(mine) is True
    assert backend.in_flight("r1") == {"r1": InFlight(1, 30)}
    assert two.release(theirs) is True


def test_a_lapsed_lease_stops_counting_without_anyone_reaping_it(backend: Backend) -> None:
    dead, alive = backend.holder("dead"), backend.holder("alive")
    dead.reserve("r1", 10)
    dead.reserve("r2", 10)
    alive.reserve("r1", 1)
    backend.wait(TTL_S * 0.5)
    alive.renew()
    backend.wait(TTL_S * 0.7)  # past the dead one's lease, within the renewed one
    assert backend.in_flight("r1", "r2") == {"r1": InFlight(1, 1)}


def test_renewing_keeps_the_reservations_past_the_ttl(backend: Backend) -> None:
    proxy = backend.holder("p1")
    proxy.reserve("r1", 3)
    for _ in range(3):
        backend.wait(TTL_S * 0.5)
        assert proxy.renew() is True
    assert backend.in_flight("r1") == {"r1": InFlight(1, 3)}


def test_a_holder_finds_out_its_lease_lapsed(backend: Backend) -> None:
    lost: list[int] = []
    proxy = backend.holder("p1", lost)
    old = proxy.reserve("r1", 3)
    proxy.reserve("r1", 4)
    backend.wait(TTL_S * 1.3)
    assert proxy.renew() is False
    assert lost == [2] and proxy.num_held() == 0
    assert proxy.release(old) is False  # it stopped counting with its lease
    assert backend.in_flight("r1") == {}
    assert proxy.renew() is True  # the new lease lives


def test_a_reservation_after_the_lease_lapsed_starts_a_new_one(backend: Backend) -> None:
    lost: list[int] = []
    proxy = backend.holder("p1", lost)
    old = proxy.reserve("r1", 3)
    backend.wait(TTL_S * 1.3)
    new = proxy.reserve("r1", 5)
    assert lost == [1]
    assert backend.in_flight("r1") == {"r1": InFlight(1, 5)}
    assert backend.store.ledger.release("p1", old.id) is False
    assert proxy.release(new) is True


def test_close_releases_everything_held(backend: Backend) -> None:
    proxy, other = backend.holder("p1"), backend.holder("p2")
    proxy.reserve("r1", 3)
    proxy.reserve("r2", 4)
    other.reserve("r2", 1)
    assert proxy.close() == 2
    assert backend.in_flight("r1", "r2") == {"r2": InFlight(1, 1)}
    assert proxy.close() == 0


def test_reads_of_nothing(backend: Backend) -> None:
    assert backend.store.ledger.in_flight([]) == {}
    assert backend.store.get_counted([]) == {}


def test_holders_on_separate_connections_see_each_other(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """Two processes' stores on one Redis (here: two clients of the private server)."""
    first, second = redis_server.client(), redis_server.client()
    stores = RedisLoadStore(first, Schema("test")), RedisLoadStore(second, Schema("test"))
    try:
        one = Reservations(stores[0].ledger, 5.0, holder="p1")
        two = Reservations(stores[1].ledger, 5.0, holder="p2")
        one.reserve("r1", 10)
        two.reserve("r1", 20)
        for store in stores:
            assert store.get_counted(["r1"])["r1"].in_flight == InFlight(2, 30)
    finally:
        for store in stores:
            store.close()


@pytest.mark.parametrize("backend", REDIS_BACKENDS, indirect=True)
def test_a_read_after_redis_forgot_its_scripts_loads_them_again(backend: Backend) -> None:
    """SCRIPT FLUSH (or a restarted Redis): the read rides in the load store's pipeline as
    EVALSHA, so its NOSCRIPT is answered by one read that loads the script."""
    assert isinstance(backend.store, RedisLoadStore)
    proxy = backend.holder("p1")
    proxy.reserve("r1", 5)
    backend.store.client.script_flush()
    assert backend.in_flight("r1") == {"r1": InFlight(1, 5)}
    backend.store.client.script_flush()
    assert proxy.release(proxy.reserve("r1", 1)) is True  # writes load theirs too
    assert backend.in_flight("r1") == {"r1": InFlight(1, 5)}


@pytest.mark.parametrize("backend", REDIS_BACKENDS, indirect=True)
def test_an_unreadable_total_reads_as_nothing_in_flight(backend: Backend) -> None:
    assert isinstance(backend.store, RedisLoadStore)
    backend.store.client.hset(Schema("test").in_flight, mapping={"r1": "many", "r2": "2"})
    assert backend.in_flight("r1", "r2") == {"r2": InFlight(2, 0)}


def test_the_totals_name_only_the_replicas_with_requests_in_flight(backend: Backend) -> None:
    proxy = backend.holder("p1")
    first = proxy.reserve("r1", 10)
    proxy.reserve("r9", 2)
    assert backend.store.ledger.totals() == {"r1": InFlight(1, 10), "r9": InFlight(1, 2)}
    assert backend.in_flight("r1", "r2") == {"r1": InFlight(1, 10)}  # r9 was not asked for
    proxy.release(first)
    assert backend.store.ledger.totals() == {"r9": InFlight(1, 2)}


def test_requests_in_flight_join_the_load_and_its_answers_then_leave_them(
    backend: Backend,
) -> None:
    """The store keeps each replica's counted load between reads; in-flight totals are read
    each time and laid over it, never kept in it."""
    loaded = Load(running=1.0, waiting=0.0, kv_usage=0.1, ts=100.0, source="push")
    backend.store.put("r1", loaded)
    backend.store.get_counted(["r1"], ["r1"])
    proxy = backend.holder("p1")
    reservation = proxy.reserve("r1", 8)
    assert backend.store.get_counted(["r1"]) == {"r1": CountedLoad(loaded, 1, InFlight(1, 8))}
    proxy.release(reservation)
    assert backend.store.get_counted(["r1"]) == {"r1": CountedLoad(loaded, 1, NO_IN_FLIGHT)}
