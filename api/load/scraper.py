"""The scraper that keeps each replica's load fresh from its vLLM ``/metrics``."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TypeAlias

import httpx

from kvindex.api.load.model import Load, LoadError
from kvindex.api.load.store import LoadStore
from kvindex.api.load.vllm_metrics import metrics_url, parse_vllm_metrics
from kvindex.api.loop.off_loop import OffLoop
from kvindex.api.loop.periodic import Periodic
from kvindex.api.loop.probe import Getter

logger = logging.getLogger(__name__)


ScrapeTarget: TypeAlias = tuple[str, str | None, str | None]
"""``(replica id, base URL or None, model name or None)``; no URL: not scraped."""


@dataclass(frozen=True, slots=True)
class ScrapeStats:
    """Scrape counters of one replica (a snapshot)."""

    num_scrapes: int = 0
    num_failures: int = 0
    last_error: str | None = None  # why the latest scrape failed; None when it succeeded
    last_success_ts: float | None = None  # ``ts`` of the latest load scraped and stored
    num_left_to_peers: int = 0  # rounds another process sharing the store scraped it


_CLAIM_SHARE = 0.8  # a claim lasts this share of the interval: gone before the next round


class MetricsScraper:
    """Scrapes every replica's ``{base_url}/metrics`` each ``interval_s`` into a store: the
    targets this process claims, concurrently, each under ``timeout_s``. No failure stops it;
    each is counted in :meth:`stats` (thread-safe) and passed to ``on_failure``."""

    def __init__(
        self,
        store: LoadStore,
        client: Getter,
        targets: Callable[[], Iterable[ScrapeTarget]],
        *,
        interval_s: float = 1.0,
        timeout_s: float = 0.5,
        clock: Callable[[], float] = time.time,
        on_failure: Callable[[str], None] = lambda _replica: None,
        off_loop: OffLoop | None = None,
    ) -> None:
        if not (interval_s > 0 and timeout_s > 0):
            raise ValueError(f"interval_s and timeout_s must be > 0, got {interval_s}, {timeout_s}")
        self._store = store
        self._targets = targets
        self._client = client
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._on_failure = on_failure
        self._off_loop = off_loop or OffLoop(blocking=True)
        self._lock = threading.Lock()
        self._replica_to_stats: dict[str, ScrapeStats] = {}
        self._rounds = Periodic("the metrics scraper", self.scrape_once, interval_s)

    async def start(self) -> None:
        """Start scraping in a task on the running loop; RuntimeError when already running."""
        await self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()

    def stats(self) -> dict[str, ScrapeStats]:
        """Counters per replica of the latest round's targets."""
        with self._lock:
            return dict(self._replica_to_stats)

    async def scrape_once(self) -> None:
        targets = await self._claimed(self._current_targets())
        await asyncio.gather(*(self._scrape(r, url, model) for r, url, model in targets))

    async def _claimed(
        self, targets: list[tuple[str, str, str | None]]
    ) -> list[tuple[str, str, str | None]]:
        """The targets no other API process scrapes this round (all when claims fail)."""
        if not targets:
            return targets
        replicas = [r for r, _, _ in targets]
        hold_s = self._interval_s * _CLAIM_SHARE
        try:
            mine = await self._off_loop(self._store.claim_scrapes, replicas, hold_s)
        except Exception:
            logger.debug("claiming this round's scrapes failed; scraping every replica")
            return targets
        for replica in set(replicas) - mine:
            self._record(replica, left_to_peers=True)
        return [t for t in targets if t[0] in mine]

    def _current_targets(self) -> list[tuple[str, str, str | None]]:
        try:
            listed = list(self._targets())
        except Exception:
            logger.exception("listing the replicas to scrape failed; skipping this round")
            return []
        # One request per replica id (the last entry wins), only for replicas with a URL.
        replica_to_target = {r: (r, url, model) for r, url, model in listed if url}
        with self._lock:
            for gone in self._replica_to_stats.keys() - replica_to_target.keys():
                del self._replica_to_stats[gone]
        return list(replica_to_target.values())

    async def _scrape(self, replica: str, base_url: str, model: str | None) -> None:
        try:
            load = await self._fetch(base_url, model)
            await self._off_loop(self._store.put, replica, load)
        except Exception as exc:
            self._record(replica, error=_describe(exc, self._timeout_s))
        else:
            self._record(replica, success_ts=load.ts)

    async def _fetch(self, base_url: str, model: str | None) -> Load:
        url = metrics_url(base_url)
        # httpx's timeout is per phase; this bounds the whole request (slow trickles too).
        async with asyncio.timeout(self._timeout_s):
            response = await self._client.get(url, timeout=self._timeout_s)
        if response.status_code != httpx.codes.OK:
            raise LoadError(f"GET {url}: HTTP {response.status_code}")
        return parse_vllm_metrics(response.text, now=self._clock(), model=model)

    def _record(
        self,
        replica: str,
        *,
        success_ts: float | None = None,
        error: str | None = None,
        left_to_peers: bool = False,
    ) -> None:
        with self._lock:
            old = self._replica_to_stats.get(replica, ScrapeStats())
            if left_to_peers:
                self._replica_to_stats[replica] = replace(
                    old, num_left_to_peers=old.num_left_to_peers + 1
                )
                return
            new = replace(old, num_scrapes=old.num_scrapes + 1, last_error=error)
            if error is None:
                new = replace(new, last_success_ts=success_ts)
            else:
                new = replace(new, num_failures=old.num_failures + 1)
            self._replica_to_stats[replica] = new
        if error is not None:
            self._on_failure(replica)
        if error is not None and old.last_error is None:
            logger.warning("scraping the load of %s fails: %s", replica, error)
        elif error is None and old.last_error is not None:
            logger.info("scraping the load of %s works again", replica)


def _describe(exc: Exception, timeout_s: float) -> str:
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return f"timed out after {timeout_s:g} s"
    text = str(exc)
    if isinstance(exc, LoadError):
        return text  # our own messages say what failed
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
