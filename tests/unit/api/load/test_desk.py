"""kvindex.api.load.desk: a request's reservation recounted once its tokens are known."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvindex.api.load.desk import DeskSeries, ReservationDesk
from kvindex.api.load.model import InFlight
from kvindex.api.load.reservations import MemoryLedger, Reservation, Reservations


class Desk:
    def __init__(self, failing: bool = False) -> None:
        registry = CollectorRegistry()
        self.series = DeskSeries(
            Gauge("in_flight", "", ["replica"], registry=registry),
            Counter("released", "", ["reason"], registry=registry),
            Counter("failures", "", ["op"], registry=registry),
        )
        self.ledger = MemoryLedger()
        reservations = _Failing(self.ledger) if failing else Reservations(self.ledger, 10.0)
        self.desk = ReservationDesk(reservations, self.series)

    def released(self) -> float:
        return sum(s.value for m in self.series.released.collect() for s in m.samples)

    def failures(self, op: str) -> float:
        return float(self.series.failures.labels(op)._value.get())


class _Failing(Reservations):
    """Takes reservations until the first recount, then the store is down."""

    def __init__(self, ledger: MemoryLedger) -> None:
        super().__init__(ledger, 10.0)
        self.down = False

    def reserve(self, replica: str, num_tokens: int) -> Reservation:
        if self.down:
            raise ConnectionError("the load store is down")
        self.down = True
        return super().reserve(replica, num_tokens)


def test_a_recount_replaces_the_tokens_and_releases_nothing() -> None:
    desk = Desk()

    async def run() -> None:
        dispatch = await desk.desk.reserve("r1", 900)
        await desk.desk.recount(dispatch, 1200)
        assert desk.ledger.totals() == {"r1": InFlight(1, 1200)}
        assert desk.desk.num_in_flight == 1 and desk.released() == 0
        await dispatch.release("done")
        await desk.desk.recount(dispatch, 50)  # released: nothing left to recount

    asyncio.run(run())
    assert desk.ledger.totals() == {}


def test_a_store_down_keeps_the_estimate() -> None:
    desk = Desk(failing=True)

    async def run() -> None:
        dispatch = await desk.desk.reserve("r1", 900)
        await desk.desk.recount(dispatch, 1200)
        assert desk.ledger.totals() == {"r1": InFlight(1, 900)}
        await dispatch.release("done")

    asyncio.run(run())
    assert desk.failures("recount") == 1
    assert desk.ledger.totals() == {}
