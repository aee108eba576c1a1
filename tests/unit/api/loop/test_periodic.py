from __future__ import annotations

import asyncio

import pytest

from kvindex.api.loop.periodic import Periodic


def test_rounds_repeat_until_stopped_and_a_failed_round_is_not_the_last() -> None:
    rounds: list[int] = []

    async def work() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 2:
            raise OSError("one bad round")

    async def main() -> None:
        periodic = Periodic("worker", work, 0.01)
        await periodic.start()
        assert periodic.running
        with pytest.raises(RuntimeError, match="already running"):
            await periodic.start()
        while len(rounds) < 4:  # past the failed second round
            await asyncio.sleep(0.005)
        await periodic.stop()
        await periodic.stop()  # idempotent
        assert not periodic.running
        done = len(rounds)
        await asyncio.sleep(0.05)
        assert len(rounds) == done  # stopped means no more rounds

    asyncio.run(main())


def test_stop_cancels_a_round_in_progress() -> None:
    async def main() -> None:
        started, gone = asyncio.Event(), asyncio.Event()

        async def work() -> None:
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                gone.set()
                raise

        periodic = Periodic("slow", work, 1.0)
        await periodic.start()
        await started.wait()
        await asyncio.wait_for(periodic.stop(), 5)
        assert gone.is_set()

    asyncio.run(main())


def test_an_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        Periodic("worker", lambda: asyncio.sleep(0), 0)
