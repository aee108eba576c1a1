"""A head's owed tokenization: counted once the request is sent, the reservation recounted to
the exact tokens, the count handed to whoever waits for it; a failure is counted and logged."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from kvindex.api.load.desk import ReservationDesk
from kvindex.api.load.reservations import MemoryLedger, Reservations
from kvindex.api.tokenize.protocol import TokenizerError, pack_ids
from kvindex.clients.proxy.metrics import ProxyMetrics
from kvindex.clients.proxy.owed_tokens import OwedTokens


def _desk(ledger: MemoryLedger) -> ReservationDesk:
    return ReservationDesk(Reservations(ledger, 10.0), ProxyMetrics().desk_series())


def test_the_count_reaches_a_caller_before_and_after_it_is_made_and_the_reservation() -> None:
    async def run() -> tuple[list[int], int]:
        ledger, gate = MemoryLedger(), asyncio.Event()
        dispatch = await _desk(ledger).reserve("r1", 100)  # the head's estimate
        pending: set[asyncio.Task[Any]] = set()

        async def rest() -> bytes:
            await gate.wait()
            return pack_ids(list(range(2000)))

        counts: list[int] = []
        owed = OwedTokens(rest, dispatch, pending, on_failure=lambda: counts.append(-1))
        owed.then(counts.append)  # before: called once counted
        await asyncio.sleep(0)
        assert counts == [] and len(pending) == 1
        gate.set()
        await asyncio.gather(*pending)
        owed.then(counts.append)  # after: called at once
        await asyncio.sleep(0)
        return counts, ledger.totals()["r1"].num_tokens

    counts, reserved = asyncio.run(run())
    assert counts == [2000, 2000]
    assert reserved == 2000


def test_a_rest_that_fails_is_counted_and_logged_and_no_count_is_handed_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def run() -> tuple[list[int], int]:
        ledger = MemoryLedger()
        dispatch = await _desk(ledger).reserve("r1", 100)
        pending: set[asyncio.Task[Any]] = set()

        async def rest() -> bytes:
            raise TokenizerError("the tokenizer broke")

        counts: list[int] = []
        owed = OwedTokens(rest, dispatch, pending, on_failure=lambda: counts.append(-1))
        owed.then(counts.append)
        await asyncio.gather(*pending)
        owed.then(counts.append)
        await asyncio.sleep(0)
        return counts, ledger.totals()["r1"].num_tokens

    with caplog.at_level(logging.ERROR, "kvindex.proxy"):
        counts, reserved = asyncio.run(run())
    assert counts == [-1]  # the failure counted, no count handed out
    assert reserved == 100  # the estimate stands
    assert "tokenizing the rest of a prompt chosen for on its head failed" in caplog.text
