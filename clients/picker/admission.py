"""Requests in flight through the picker: at most ``max_in_flight`` (past it, shed), each
reserved in the shared load store and released exactly once; a store down never fails a pick."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvindex.api.load.reservations import Reservation, Reservations
from kvindex.api.loop.off_loop import OffLoop
from kvindex.clients.picker.metrics import PickerMetrics

logger = logging.getLogger("kvindex.picker")


@dataclass(slots=True)
class Ticket:
    """One admitted request on ``replica`` (``reservation`` None: the store did not take it)."""

    replica: str
    reservation: Reservation | None
    released: bool = False


class Admission:
    """Counts and reserves; used on one event loop (the count is not locked)."""

    def __init__(
        self,
        reservations: Reservations,
        metrics: PickerMetrics,
        *,
        max_in_flight: int,
        blocking: bool,
    ) -> None:
        self._reservations = reservations
        self._metrics = metrics
        self._max_in_flight = max_in_flight
        self._call = OffLoop(blocking).shielded
        self.num_in_flight = 0

    def full(self) -> bool:
        """At the limit: the next request is shed (429)."""
        return self.num_in_flight >= self._max_in_flight

    async def admit(self, replica: str, num_uncached_tokens: int) -> Ticket:
        self.num_in_flight += 1
        self._metrics.child(self._metrics.in_flight, replica).inc()
        reservation = None
        try:
            reservation = await self._call(self._reservations.reserve, replica, num_uncached_tokens)
        except Exception as exc:
            self._failed("reserve", exc)
        return Ticket(replica, reservation)

    async def release(self, ticket: Ticket, reason: str) -> None:
        if ticket.released:
            return
        ticket.released = True
        self.num_in_flight -= 1
        self._metrics.child(self._metrics.in_flight, ticket.replica).dec()
        self._metrics.child(self._metrics.released, reason).inc()
        if ticket.reservation is None:
            return
        try:
            await self._call(self._reservations.release, ticket.reservation)
        except Exception as exc:
            self._failed("release", exc)  # Reservations tries it again at its next renewal

    async def move(self, ticket: Ticket, replica: str) -> Ticket:
        """The request was served by ``replica`` instead: its reservation goes there."""
        if ticket.released or ticket.replica == replica:
            return ticket
        num_tokens = ticket.reservation.num_tokens if ticket.reservation is not None else 0
        await self.release(ticket, "done")
        return await self.admit(replica, num_tokens)

    async def close(self) -> None:
        """End the lease: whatever is still reserved is released (reason ``shutdown``)."""
        try:
            num_held = await self._call(self._reservations.close)
        except Exception as exc:
            self._failed("close", exc)  # the lease lapses on its own
            return
        if num_held:
            self._metrics.released.labels("shutdown").inc(num_held)

    def _failed(self, op: str, exc: Exception) -> None:
        self._metrics.reservation_failures.labels(op).inc()
        logger.warning("reservations: %s failed: %s", op, exc)
