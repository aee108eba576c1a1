"""Building blocks for read-path tests: an app over either store, filled through ingest.

:class:`Fleet` caches blocks the way the write path does (``Ingestor.apply`` with vLLM's
``BlockStored`` events, extra keys as vLLM publishes them) and marks streams live, stale or
replaying in the registry. :class:`Api` drives an app in-process over
``httpx.ASGITransport``; :func:`serving_http` serves one with a real uvicorn on loopback.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI

from kvindex.api.config.settings import ApiSettings
from kvindex.api.http.app import create_app, hot_serving
from kvindex.api.http.background import BackgroundServer
from kvindex.api.http.server_protocol import hot_protocol
from kvindex.api.load.store import LoadStore
from kvindex.api.runtime import ApiDeps
from kvindex.api.schemas import ScoreEntry, ScoreResponse
from kvindex.indexer.domain.events import BlockStored, EventBatch, ExtraKeys, StreamId, Tier
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.protocol import BlockIndex
from kvindex.indexer.ingest.ingestor import Ingestor

MODEL = "demo-model"
BLOCK = 16
"""Tokens per block in every test (vLLM's default)."""
BASE_URL = "http://kvindex.test"


CLOCK_FIELDS = ("lag_s", "silent_s")
"""A score entry's freshness fields that depend on the clock (stream ages)."""


def comparable_body(content: bytes) -> object:
    """The body, less what depends on the clock (a score answer's stream ages): two
    servers' answers to the same request compare equal."""
    try:
        decoded = msgspec.json.decode(content)
    except msgspec.DecodeError:
        return content
    if isinstance(decoded, dict):
        for entry in decoded.get("scores", []):
            for name in CLOCK_FIELDS:
                assert isinstance(entry["freshness"].pop(name), float)
    return decoded


def tokens(first_id: int, num_blocks: int, tail: int = 0) -> list[int]:
    """``num_blocks`` full blocks (plus ``tail`` tokens) of consecutive ids from ``first_id``."""
    return list(range(first_id, first_id + num_blocks * BLOCK + tail))


@dataclass
class Fleet:
    """The registry and index behind an app, filled the way the indexer fills them."""

    index: BlockIndex
    registry: Registry
    ingestor: Ingestor
    seqs: dict[StreamId, int] = field(default_factory=dict)
    hashes: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    @classmethod
    def over(cls, index: BlockIndex) -> Fleet:
        return cls(index, Registry(), Ingestor(index))

    def add(self, *replicas: str, dp_size: int = 1, model: str = MODEL) -> None:
        """Register replicas with every rank live."""
        for replica in replicas:
            self.registry.add(ReplicaSpec(id=replica, model=model, dp_size=dp_size))
            for rank in range(dp_size):
                self.live(StreamId(replica, rank))

    def store(
        self,
        replica: str,
        token_ids: list[int],
        *,
        rank: int = 0,
        tier: Tier = Tier.GPU,
        lora_name: str | None = None,
        extra_keys: Sequence[ExtraKeys] | None = None,
        model: str = MODEL,
    ) -> None:
        """Cache the full blocks of ``token_ids`` on one stream: one vLLM ``BlockStored``
        (with ``lora_name`` and per-block ``extra_keys`` as given), applied by the real
        ingest path, then mark the stream live."""
        stream = StreamId(replica, rank)
        num_blocks = len(token_ids) // BLOCK
        event = BlockStored(
            block_hashes=tuple(next(self.hashes) for _ in range(num_blocks)),
            parent_hash=None,
            token_ids=token_ids[: num_blocks * BLOCK],
            block_size=BLOCK,
            tier=tier,
            lora_name=lora_name,
            extra_keys=extra_keys,
        )
        seq = self.seqs.get(stream, -1) + 1
        self.seqs[stream] = seq
        report = self.ingestor.apply(stream, model, EventBatch(seq, time.time(), rank, [event]))
        assert report.applied and report.num_blocks_stored == num_blocks, report
        self.registry.record(stream, StreamReport(block_size=BLOCK))
        self.live(stream)

    def live(self, stream: StreamId) -> None:
        seq = self.seqs.get(stream, -1)
        heard = StreamReport(
            last_seq=seq, last_event_ts=time.time(), replaying=False, connected=True
        )
        self.registry.record(stream, heard)

    def stale(self, replica: str) -> None:
        """Disconnected: the registry marks a stream stale as soon as it disconnects."""
        self.registry.record(StreamId(replica), StreamReport(connected=False))

    def replaying(self, replica: str) -> None:
        self.registry.record(StreamId(replica), StreamReport(replaying=True))


@dataclass
class Api:
    """An app driven in-process through ``httpx.AsyncClient(transport=ASGITransport(app))``.

    One ``asyncio.Runner`` (the loop ``asyncio.run`` would make) lives as long as the Api,
    so the app's lifespan spans every request and ends on :meth:`close`.
    """

    app: FastAPI
    fleet: Fleet
    loads: LoadStore
    runner: asyncio.Runner
    client: httpx.AsyncClient
    stack: AsyncExitStack

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        headers: dict[str, str] | None = None,
        content: bytes | None = None,
    ) -> httpx.Response:
        """One request (``body`` as JSON, or raw ``content``), answered in-process."""
        call = self.client.request(method, path, json=body, content=content, headers=headers)
        return self.runner.run(call)

    def get(self, path: str) -> httpx.Response:
        return self.request("GET", path)

    def post(self, path: str, body: Any) -> httpx.Response:
        return self.request("POST", path, body)

    def score(self, **body: Any) -> ScoreResponse:
        """``POST /score`` (model defaults to MODEL); asserts 200 and decodes the answer."""
        response = self.post("/score", {"model": MODEL} | body)
        assert response.status_code == 200, response.text
        return msgspec.json.decode(response.content, type=ScoreResponse)

    def push_load(
        self, replica: str, *, running: float, waiting: float, kv_usage: float, **more: Any
    ) -> None:
        report = {"replica": replica, "running": running, "waiting": waiting} | more
        response = self.post("/load", report | {"kv_usage": kv_usage})
        assert response.status_code == 200, response.text

    def close(self) -> None:
        try:
            self.runner.run(self.stack.aclose())
        finally:
            self.runner.close()


def open_api(
    settings: ApiSettings,
    index: BlockIndex,
    loads: LoadStore,
    *,
    blocking_store: bool,
    lean_routes: bool = True,
) -> Api:
    """An app over ``index`` and ``loads`` (the caller closes those), lifespan started
    (``lean_routes`` as ``create_app`` takes it)."""
    fleet = Fleet.over(index)
    deps = ApiDeps(settings, index, fleet.registry, loads, blocking_store)
    app = create_app(deps, lean_routes=lean_routes)
    runner = asyncio.Runner()
    stack = AsyncExitStack()
    try:
        client = runner.run(_enter(stack, app))
    except BaseException:
        runner.close()
        raise
    return Api(app, fleet, loads, runner, client, stack)


async def _enter(stack: AsyncExitStack, app: FastAPI) -> httpx.AsyncClient:
    await stack.enter_async_context(app.router.lifespan_context(app))
    transport = httpx.ASGITransport(app=app)
    client = httpx.AsyncClient(transport=transport, base_url=BASE_URL)
    return await stack.enter_async_context(client)


def entry(answer: ScoreResponse, replica: str) -> ScoreEntry:
    """The answer's entry for one replica."""
    found = [e for e in answer.scores if e.replica == replica]
    assert len(found) == 1, f"{replica} not exactly once in {[e.replica for e in answer.scores]}"
    return found[0]


def matched(answer: ScoreResponse) -> dict[str, int]:
    """Matched blocks by replica."""
    return {e.replica: e.matched_blocks for e in answer.scores}


@contextmanager
def serving_http(app: FastAPI, settings: ApiSettings) -> Iterator[str]:
    """Serve ``app`` with uvicorn on ``settings.host:port`` in a background thread; yields
    the base URL; stops the server (``should_exit``) and joins the thread on exit."""
    # As `kvindex serve` and `kvindex api` serve it: the hot routes answered by the protocol.
    protocol = hot_protocol(settings.header_timeout_s, hot_serving(app))
    server = BackgroundServer(app, host=settings.host, port=settings.port, http=protocol).start()
    try:
        yield server.base_url
    finally:
        server.stop()
    assert not server.running, "the API server did not stop"
