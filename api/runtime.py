"""The read path's one assembly: ``kvindex api``, ``serve`` and ``proxy`` open their stores
with :func:`open_stores` and build their runtime with :func:`build_read_path`, adding their
own parts through :class:`Hooks`."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import httpx

from kvindex.api.config.settings import ApiSettings, ReadPathSettings
from kvindex.api.health.block_sizes import BlockSizeCheck
from kvindex.api.health.checker import HealthChecker
from kvindex.api.load.scraper import MetricsScraper
from kvindex.api.load.store import LoadStore, MemoryLoadStore
from kvindex.api.loop.off_loop import OffLoop
from kvindex.api.loop.periodic import Periodic
from kvindex.api.loop.probe import Probes
from kvindex.api.score import Scorer
from kvindex.api.tokenize.failover import FleetTokenizers
from kvindex.indexer.config.store import StoreSettings
from kvindex.indexer.fleet.registry import RegistryView
from kvindex.indexer.fleet.replica_health import Ejection
from kvindex.indexer.index.circuit import StoreCircuit
from kvindex.indexer.index.protocol import BlockIndex, IndexUnavailableError

if TYPE_CHECKING:  # imported where used: a memory-store process loads no Redis client
    from kvindex.indexer.index.redis import RedisIndex

log = logging.getLogger("kvindex.api")
BLOCK_SIZE_CHECK_S = 5.0


@dataclass
class ApiDeps:
    """The stores a read path reads, and its settings; the caller owns the stores."""

    settings: ApiSettings
    index: BlockIndex
    registry: RegistryView
    loads: LoadStore
    blocking_store: bool
    """Index and load calls do network I/O: run them off the loop."""
    runs_write_path: bool = True
    """This process runs the indexer behind ``registry`` and ``index``."""
    circuit: StoreCircuit | None = None


class Writer(Protocol):
    """What the in-process write path lends the read path (``IndexerService`` is one)."""

    @property
    def index(self) -> BlockIndex: ...
    @property
    def registry(self) -> RegistryView: ...


def open_stores(settings: ReadPathSettings, writer: Writer | None = None) -> ApiDeps:
    """The ``writer``'s memory stores, or the API's own bounded Redis connection (the fleet
    read from Redis unless a ``writer`` runs here); ValueError: memory without a writer."""
    store, api = settings.store, settings.api
    if store.store == "redis":
        index, loads, fleet, circuit = bounded_stores(store, api)
        registry = writer.registry if writer is not None else fleet
        return ApiDeps(api, index, registry, loads, True, writer is not None, circuit)
    if writer is None:
        raise ValueError("the memory store is read in the process that writes it")
    return ApiDeps(api, writer.index, writer.registry, MemoryLoadStore(), False, True)


def bounded_stores(
    store: StoreSettings, api: ApiSettings
) -> tuple[BlockIndex, LoadStore, RegistryView, StoreCircuit]:
    """The API's index, load and fleet on one connection (every call bounded by
    ``api.redis_timeout_s``), behind one shared circuit."""
    from kvindex.api.load.store import CircuitLoadStore, RedisLoadStore  # noqa: PLC0415
    from kvindex.indexer.fleet.view import RedisFleetView  # noqa: PLC0415
    from kvindex.indexer.index.circuit import CircuitIndex  # noqa: PLC0415
    from kvindex.indexer.index.redis import RedisIndex  # noqa: PLC0415
    from kvindex.indexer.redis.connection import connect_bounded  # noqa: PLC0415

    schema = store.redis_schema
    client = connect_bounded(
        store.redis_url, timeout_s=api.redis_timeout_s, cluster=store.redis_cluster
    )
    circuit = StoreCircuit(api.redis_cooldown_s)
    index = CircuitIndex(_checked_index(RedisIndex(client, schema)), circuit)
    loads = CircuitLoadStore(RedisLoadStore(client, schema), circuit)
    fleet = RedisFleetView(client, schema, stale_after_s=store.stale_after_s, circuit=circuit)
    return index, loads, fleet, circuit


def _checked_index(index: RedisIndex) -> RedisIndex:
    """``index``, its schema checked now, or at its first lookup if Redis is down at start."""
    try:
        index.check_schema()
    except IndexUnavailableError as exc:
        log.warning("redis unreachable at start, its index is checked when it answers: %s", exc)
    return index


def _same(index: BlockIndex) -> BlockIndex:
    return index


def _ignore(*_args: object) -> None:
    return None


@dataclass(frozen=True)
class Hooks:
    """What a process adds to its read path: an index wrapper, callbacks, tokenizer failover."""

    wrap_index: Callable[[BlockIndex], BlockIndex] = _same
    on_degraded: Callable[[str], None] = _ignore
    on_scrape_failure: Callable[[str], None] = _ignore
    on_ejected: Callable[[str, Ejection], None] = _ignore
    on_check_stalled: Callable[[str], None] = _ignore
    distrusted: Callable[[], Collection[str]] = frozenset  # discounted now (the proxy's)


@dataclass
class ReadPath:
    """One process's read-path runtime; :meth:`start` and :meth:`stop` run on its loop."""

    deps: ApiDeps
    off_loop: OffLoop
    index: BlockIndex
    http: httpx.AsyncClient
    probes: Probes
    tokenizers: FleetTokenizers
    scorer: Scorer
    scraper: MetricsScraper | None
    health_checker: HealthChecker
    block_sizes: BlockSizeCheck
    _block_size_rounds: Periodic

    async def start(self) -> None:
        if self.scraper is not None:
            await self.scraper.start()
        await self.health_checker.start()
        await self._block_size_rounds.start()

    async def stop(self) -> None:
        await self._block_size_rounds.stop()
        if self.scraper is not None:
            await self.scraper.stop()
        await self.health_checker.stop()
        await self.tokenizers.aclose()
        await self.probes.aclose()
        await self.http.aclose()

    def scrape_targets(self) -> list[tuple[str, str, str]]:
        return [(r.id, r.url, r.model) for r in self.deps.registry.replicas() if r.url]


def build_read_path(deps: ApiDeps, hooks: Hooks | None = None) -> ReadPath:
    hooks = hooks or Hooks()
    settings, registry = deps.settings, deps.registry
    off_loop = OffLoop(deps.blocking_store)
    index = hooks.wrap_index(deps.index)
    http = httpx.AsyncClient(
        timeout=settings.scrape_timeout_s, trust_env=False, transport=_LazyTransport()
    )
    probes = Probes(http)  # the checks' and scrapes' GETs, the replica tokenizers' POSTs
    tokenizers = FleetTokenizers(settings, registry, probes)
    scorer = Scorer(
        settings,
        index,
        registry,
        deps.loads,
        tokenizers=tokenizers.tokenizer,
        blocking_store=deps.blocking_store,
        on_degraded=hooks.on_degraded,
        distrusted=hooks.distrusted,
    )
    checker = HealthChecker(
        settings,
        registry,
        probes,
        blocking_store=deps.blocking_store,
        on_ejected=hooks.on_ejected,
        on_stalled=hooks.on_check_stalled,
    )
    block_sizes = BlockSizeCheck(settings, registry)
    rounds = Periodic("the block-size check", _check(off_loop, block_sizes), BLOCK_SIZE_CHECK_S)
    runtime = ReadPath(
        deps, off_loop, index, http, probes, tokenizers, scorer, None, checker, block_sizes, rounds
    )
    if settings.scrape_interval_s > 0:
        runtime.scraper = MetricsScraper(
            deps.loads,
            probes,
            runtime.scrape_targets,
            interval_s=settings.scrape_interval_s,
            timeout_s=settings.scrape_timeout_s,
            on_failure=hooks.on_scrape_failure,
            off_loop=off_loop,
        )
    return runtime


def _check(off_loop: OffLoop, block_sizes: BlockSizeCheck) -> Callable[[], Awaitable[None]]:
    """One round of the block-size check (a mismatch is logged when it appears)."""

    async def check() -> None:
        await off_loop(block_sizes.mismatches)

    return check


class _LazyTransport(httpx.AsyncBaseTransport):
    """httpx's transport (no proxy from the environment), built on the first request."""

    def __init__(self) -> None:
        self._transport: httpx.AsyncHTTPTransport | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._transport is None:
            self._transport = httpx.AsyncHTTPTransport(trust_env=False)
        return await self._transport.handle_async_request(request)

    async def aclose(self) -> None:
        if self._transport is not None:
            await self._transport.aclose()
