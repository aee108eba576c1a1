"""A request chosen for on its prompt's head: the whole prompt's tokenization it owes, run while
the replica answers; then its reservation recounted, its prediction made with the exact count.
A failure is logged and counted: the choice stands, with no prediction."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from kvindex.api.load.desk import Dispatch

logger = logging.getLogger("kvindex.proxy")

Rest = Callable[[], Coroutine[Any, Any, bytes]]


class OwedTokens:
    """Started when made (on the running loop); ``pending`` holds its task until it ends."""

    def __init__(
        self,
        rest: Rest,
        dispatch: Dispatch | None,
        pending: set[asyncio.Task[Any]],
        *,
        on_failure: Callable[[], object],
    ) -> None:
        self._on_failure = on_failure
        self._task = asyncio.create_task(self._count(rest, dispatch))
        pending.add(self._task)
        self._task.add_done_callback(pending.discard)

    def then(self, call: Callable[[int], object]) -> None:
        """``call`` with the prompt's tokens once counted; never if the rest failed."""
        if self._task.done():
            self._with(call, self._task)
        else:
            self._task.add_done_callback(lambda task: self._with(call, task))

    async def _count(self, rest: Rest, dispatch: Dispatch | None) -> int | None:
        try:
            num_tokens = len(await rest()) // 4
        except Exception:  # the tokenizer's own failure: the choice stands
            self._on_failure()
            logger.exception("tokenizing the rest of a prompt chosen for on its head failed")
            return None
        if dispatch is not None:  # no replica held any of it: every token uncached
            await dispatch.recount(num_tokens)
        return num_tokens

    @staticmethod
    def _with(call: Callable[[int], object], task: asyncio.Task[int | None]) -> None:
        if not task.cancelled() and task.exception() is None and (n := task.result()):
            call(n)
