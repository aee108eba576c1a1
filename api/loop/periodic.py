"""A round of work repeated on the running loop: the one lifecycle of the read path's
background workers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)


class Periodic:
    """``work()`` every ``interval_s`` (the first at :meth:`start`, the next at once if one
    overran) until :meth:`stop`; a failed round is logged and the rounds go on."""

    def __init__(self, name: str, work: Callable[[], Awaitable[object]], interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"{name}: interval_s must be > 0, got {interval_s!r}")
        self._name = name
        self._work = work
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None

    async def start(self) -> None:
        """Start the rounds in a task; RuntimeError when already running."""
        if self._task is not None:
            raise RuntimeError(f"{self._name} is already running")
        self._task = asyncio.get_running_loop().create_task(self._rounds(), name=self._name)

    async def stop(self) -> None:
        """Cancel the task and wait until it and its round are gone (idempotent)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        # wait(), not "await task": a cancellation of stop() itself must still propagate.
        await asyncio.wait([task])

    async def _rounds(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self._work()
            except Exception:  # this round failed: the next one is tried on time
                logger.exception("%s: a round failed", self._name)
            await asyncio.sleep(max(0.0, started + self._interval_s - loop.time()))
