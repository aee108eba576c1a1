"""A ``tokenizer.json`` found in the hub cache, checked against the model's replicas: both
encode the probe (a prompt and a chat); the same ids: it tokenizes the model; other ids (an
older snapshot, a ``--chat-template`` of the engines'): the replicas do, and a warning says
so; no replica answering: it goes on, and is checked again :data:`RETRY_S` later."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from kvindex.api.tokenize.protocol import Tokenizer, TokenizerError
from kvindex.api.tokenize.renderers import PROBE_MESSAGES, PROBE_PROMPT

RETRY_S = 30.0
logger = logging.getLogger("kvindex.tokenize")


class HubCheck:
    """Each hub-found tokenizer's verdict, by model; the checks run on the caller's loop."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._agrees: dict[str, bool] = {}
        self._asked_at: dict[str, float] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def trusted(self, model: str, local: Tokenizer, replicas: Tokenizer) -> bool:
        """False once ``local``'s ids differed from ``replicas``'; else True, its check
        started when due (none without a running loop)."""
        agrees = self._agrees.get(model)
        if agrees is not None:
            return agrees
        now, asked = self._clock(), self._asked_at.get(model)
        if asked is None or now - asked >= RETRY_S:
            self._asked_at[model] = now
            self._start(model, local, replicas)
        return True

    def verdicts(self) -> dict[str, str]:
        """Each model found in the hub: ``agrees``, ``differs`` or ``unchecked``."""
        agrees = self._agrees
        return {
            m: "unchecked" if m not in agrees else "agrees" if agrees[m] else "differs"
            for m in self._asked_at
        }

    def forget(self, model: str) -> None:
        self._agrees.pop(model, None)
        self._asked_at.pop(model, None)

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _start(self, model: str, local: Tokenizer, replicas: Tokenizer) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(self._check(model, local, replicas))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _check(self, model: str, local: Tokenizer, replicas: Tokenizer) -> None:
        try:
            theirs = await _probe(replicas)
        except TokenizerError as exc:
            logger.info("%s: the hub cache's tokenizer not checked yet: %s", model, exc)
            return
        try:
            mine: tuple[list[int], list[int]] | None = await _probe(local)
        except TokenizerError:
            mine = None
        self._agrees[model] = agrees = mine == theirs
        if agrees:
            logger.info("%s: the hub cache's tokenizer tokenizes as the replicas do", model)
        else:
            logger.warning(
                "%s: the hub cache's tokenizer.json tokenizes unlike the model's replicas "
                "(another snapshot or chat template?): the replicas tokenize it", model
            )  # fmt: skip


async def _probe(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    return (
        await tokenizer.encode_prompt(PROBE_PROMPT),
        await tokenizer.encode_messages(PROBE_MESSAGES),
    )
