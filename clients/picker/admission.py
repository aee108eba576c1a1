"""Requests in flight through the picker: at most ``max_in_flight`` (past it, shed), each
reserved on a :class:`ReservationDesk` (as the proxy's), moved to the endpoint that served it."""

from __future__ import annotations

from kvindex.api.load.desk import Dispatch, ReservationDesk

Ticket = Dispatch
"""One admitted request."""


class Admission:
    """The desk behind a limit; used on one event loop."""

    def __init__(self, desk: ReservationDesk, *, max_in_flight: int) -> None:
        self.desk = desk
        self._max_in_flight = max_in_flight

    @property
    def num_in_flight(self) -> int:
        return self.desk.num_in_flight

    def full(self) -> bool:
        """At the limit: the next request is shed (429)."""
        return self.desk.num_in_flight >= self._max_in_flight

    async def admit(self, replica: str, num_uncached_tokens: int) -> Ticket:
        return await self.desk.reserve(replica, num_uncached_tokens)

    async def release(self, ticket: Ticket, reason: str) -> None:
        await self.desk.release(ticket, reason)

    async def move(self, ticket: Ticket, replica: str) -> Ticket:
        """The request was served by ``replica`` instead: its reservation goes there."""
        if ticket.released or ticket.replica == replica:
            return ticket
        num_tokens = ticket.reservation.num_tokens if ticket.reservation is not None else 0
        await self.release(ticket, "done")
        return await self.admit(replica, num_tokens)

    async def recount(self, ticket: Ticket, num_uncached_tokens: int) -> None:
        """The request's uncached tokens, counted now (they were estimated)."""
        await self.desk.recount(ticket, num_uncached_tokens)

    async def close(self) -> None:
        """End the lease: whatever is still reserved is released (reason ``shutdown``)."""
        await self.desk.close()
