"""kvindex.api.load.reservations: what the contract suite does not cover (the lease keeper,
the holder's arguments); the ledgers' behaviour is tests/contract/test_reservation_contract.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvindex.api.load.reservations import LeaseKeeper, MemoryLedger, Reservations, new_holder
from kvindex.indexer.index.protocol import IndexUnavailableError
from kvindex.indexer.redis.schema import SchemaError, check_name


def test_the_lease_keeper_renews_until_stopped_and_counts_failures() -> None:
    class FlakyLedger(MemoryLedger):
        num_renewals = 0

        def renew(self, holder: str, lease_ttl_s: float) -> bool:
            self.num_renewals += 1
            if self.num_renewals == 2:
                raise IndexUnavailableError("redis: connection refused")
            return super().renew(holder, lease_ttl_s)

    ledger = FlakyLedger()
    failures: list[None] = []
    keeper = LeaseKeeper(
        Reservations(ledger, 0.06), blocking=False, on_failure=lambda: failures.append(None)
    )

    async def run() -> None:
        await keeper.start()
        with pytest.raises(RuntimeError):
            await keeper.start()
        await asyncio.sleep(0.2)  # a renewal every 20 ms
        await keeper.stop()
        await keeper.stop()  # idempotent

    asyncio.run(run())
    stopped_at = ledger.num_renewals
    assert stopped_at >= 3 and failures == [None]
    time.sleep(0.05)
    assert ledger.num_renewals == stopped_at


def test_a_holder_needs_a_positive_ttl_and_a_key_safe_name() -> None:
    with pytest.raises(ValueError, match="lease_ttl_s"):
        Reservations(MemoryLedger(), 0.0)
    with pytest.raises(SchemaError):
        Reservations(MemoryLedger(), 1.0, holder="a{b}")
    assert check_name("holder", new_holder()) != new_holder()  # unique, key-safe


def test_a_failed_release_is_made_at_the_next_renewal() -> None:
    class DownOnce(MemoryLedger):
        down = True

        def release(self, holder: str, reservation_id: str) -> bool:
            if self.down:
                self.down = False
                raise IndexUnavailableError("redis: connection refused")
            return super().release(holder, reservation_id)

    ledger = DownOnce()
    holder = Reservations(ledger, 10.0)
    reservation = holder.reserve("r1", 4)
    with pytest.raises(IndexUnavailableError):
        holder.release(reservation)
    assert ledger.in_flight(["r1"]) != {}  # still counted: the store never heard
    assert holder.renew() is True
    assert ledger.in_flight(["r1"]) == {}
