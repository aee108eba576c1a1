"""A request's reservation in the shared load store, made and released once, and counted: the
proxy reserves each attempt, the picker each pick; a store down never fails a request."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from kvindex.api.load.reservations import Reservation, Reservations
from kvindex.api.loop.off_loop import OffLoop

_LOG = logging.getLogger("kvindex.load")


@dataclass(frozen=True, slots=True)
class DeskSeries:
    """A process's series of its desk: in flight by ``replica``, released by ``reason``, failed
    load-store calls by ``op``."""

    in_flight: Gauge
    released: Counter
    failures: Counter


@dataclass(slots=True)
class Dispatch:
    """One request in flight to ``replica`` (``reservation`` None: the store did not take it)."""

    desk: ReservationDesk
    replica: str
    reservation: Reservation | None
    released: bool = False

    async def release(self, reason: str) -> None:
        """No longer in flight, for ``reason``; once."""
        await self.desk.release(self, reason)

    async def recount(self, num_uncached_tokens: int) -> None:
        """Its uncached tokens, counted now (they were estimated)."""
        await self.desk.recount(self, num_uncached_tokens)


class ReservationDesk:
    """Reserves and releases on one event loop (``num_in_flight`` is not locked); without
    ``reservations`` only the series are kept."""

    def __init__(
        self,
        reservations: Reservations | None,
        series: DeskSeries,
        *,
        blocking: bool = False,
        log: logging.Logger = _LOG,
    ) -> None:
        self.reservations = reservations
        self.series = series
        self.log = log
        self.num_in_flight = 0
        self._blocking = blocking
        self._call = OffLoop(blocking).shielded
        self._in_flight_of: dict[str, Gauge] = {}
        self._released_by: dict[str, Counter] = {}

    async def reserve(self, replica: str, num_uncached_tokens: int) -> Dispatch:
        self.num_in_flight += 1
        self._gauge(replica).inc()
        reservation = None
        if self.reservations is not None:
            try:
                if self._blocking:
                    reservation = await self._call(
                        self.reservations.reserve, replica, num_uncached_tokens
                    )
                else:  # inline, as OffLoop would call it (no coroutine made)
                    reservation = self.reservations.reserve(replica, num_uncached_tokens)
            except Exception as exc:
                self._failed("reserve", exc)
        return Dispatch(self, replica, reservation)

    async def release(self, dispatch: Dispatch, reason: str) -> None:
        if dispatch.released:
            return
        dispatch.released = True
        self.num_in_flight -= 1
        self._gauge(dispatch.replica).dec()
        self._released(reason).inc()
        if self.reservations is None or dispatch.reservation is None:
            return
        try:
            if self._blocking:
                await self._call(self.reservations.release, dispatch.reservation)
            else:
                self.reservations.release(dispatch.reservation)
        except Exception as exc:
            self._failed("release", exc)  # Reservations tries it again at its next renewal

    async def recount(self, dispatch: Dispatch, num_uncached_tokens: int) -> None:
        """Reserve ``dispatch`` again at ``num_uncached_tokens`` (its count was an estimate):
        the new reservation made before the old is released, no release counted."""
        old, reservations = dispatch.reservation, self.reservations
        if dispatch.released or old is None or reservations is None:
            return
        if old.num_tokens == num_uncached_tokens:
            return
        try:
            new = await self._call(reservations.reserve, dispatch.replica, num_uncached_tokens)
            if dispatch.released:  # released meanwhile: the old one with it
                await self._call(reservations.release, new)
                return
            dispatch.reservation = new
            await self._call(reservations.release, old)
        except Exception as exc:
            self._failed("recount", exc)  # the estimate stands

    async def close(self) -> None:
        """End the lease: whatever is still reserved is released (reason ``shutdown``)."""
        if self.reservations is None:
            return
        try:
            num_held = await self._call(self.reservations.close)
        except Exception as exc:
            self._failed("close", exc)  # the lease lapses on its own
            return
        if num_held:
            self._released("shutdown").inc(num_held)

    def _gauge(self, replica: str) -> Gauge:
        # Labelled children kept: prometheus' own lookup locks and joins on each call.
        found = self._in_flight_of.get(replica)
        if found is None:
            found = self._in_flight_of[replica] = self.series.in_flight.labels(replica)
        return found

    def _released(self, reason: str) -> Counter:
        found = self._released_by.get(reason)
        if found is None:
            found = self._released_by[reason] = self.series.released.labels(reason)
        return found

    def _failed(self, op: str, exc: Exception) -> None:
        self.series.failures.labels(op).inc()
        self.log.warning("reservations: %s failed: %s", op, exc)
