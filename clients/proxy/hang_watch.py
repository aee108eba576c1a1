"""Passive hang detection: a replica that owes an answer and has sent not one byte for
``proxy.hang_silence_s`` is suspect, and a health probe decides (``confirm``); one found hung
has its requests still waiting with no byte abandoned, which the forwarder sends elsewhere.
A request waits on a hung replica at most ``hang_silence_s`` * 1.5 + the probe's timeout."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import httpx

from kvindex.api.loop.periodic import Periodic
from kvindex.clients.proxy.connections import ReplicaTransport

logger = logging.getLogger("kvindex.proxy")
Confirm = Callable[[str, float], Awaitable[bool]]
"""(replica, seconds silent) → whether it is hung (its health probe failed; it is ejected)."""


class HangWatch:
    """Looks every quarter of ``silence_s`` at the replicas this proxy has sent to; a
    replica that passed its probe is not probed again for ``silence_s``."""

    def __init__(self, transport: ReplicaTransport, silence_s: float, confirm: Confirm) -> None:
        self._transport = transport
        self._silence_s = silence_s
        self._confirm = confirm
        self._replica_to_address: dict[str, tuple[str, int]] = {}
        self._cleared_at: dict[str, float] = {}
        self._rounds = Periodic("the hang watch", self.check_once, silence_s / 4)

    @property
    def running(self) -> bool:
        return self._rounds.running

    async def start(self) -> None:
        if not self._rounds.running:
            await self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()

    def note(self, replica: str, url: httpx.URL) -> None:
        """``replica`` is reached at ``url``'s address (called for each attempt)."""
        self._replica_to_address[replica] = (url.host, url.port or 80)

    def abandon(self, replica: str, why: str) -> int:
        """Abandon the requests waiting on ``replica`` with no byte yet; how many."""
        address = self._replica_to_address.get(replica)
        if address is None:
            return 0
        num_abandoned = self._transport.abandon(*address, why)
        if num_abandoned:
            logger.warning(
                "replica %s: %d requests waiting with no byte sent elsewhere (%s)",
                replica,
                num_abandoned,
                why,
            )
        return num_abandoned

    async def check_once(self) -> list[str]:
        """Probe the replicas silent for ``silence_s`` (together); the ones found hung."""
        now = asyncio.get_running_loop().time()
        silent = {}
        for replica, address in self._replica_to_address.items():
            cleared = now - self._cleared_at.get(replica, float("-inf"))
            silent_s = min(self._transport.silent_s(*address, now), cleared)
            if silent_s >= self._silence_s:
                silent[replica] = silent_s
        verdicts = await asyncio.gather(*(self._confirm(r, s) for r, s in silent.items()))
        hung = []
        for (replica, silent_s), verdict in zip(silent.items(), verdicts, strict=True):
            if verdict:
                hung.append(replica)
                self.abandon(replica, f"hung: no byte for {silent_s:.1f}s")
            else:
                self._cleared_at[replica] = asyncio.get_running_loop().time()
        return hung
