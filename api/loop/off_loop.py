"""Blocking store calls off the event loop: the one helper the read path runs them with."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class OffLoop:
    """Runs a call in a worker thread when ``blocking`` (network stores), else inline."""

    __slots__ = ("blocking",)

    def __init__(self, blocking: bool) -> None:
        self.blocking = blocking

    async def __call__(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        if self.blocking:
            return await asyncio.to_thread(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    async def shielded(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """As a call, but a cancelled caller still waits for it (the thread runs anyway)."""
        if self.blocking:
            return await asyncio.shield(asyncio.to_thread(fn, *args, **kwargs))
        return fn(*args, **kwargs)
