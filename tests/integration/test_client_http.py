"""kvindex.clients.http against the real API app, served by uvicorn on a free loopback port.

The fixture builds the app from an in-process index holding a few blocks (put in with the
real Ingestor), serves it in a background thread, and stops it (``should_exit``, join)
after the test. Every test using the ``client`` fixture runs with the sync client and with
the async one (driven through :class:`Blocking`), so both are exercised end to end.

Fleet: ``r1`` holds the first 4 blocks of :data:`PREFIX`; ``r2`` the first 2, plus the
first 3 under the LoRA adapter ``sql``. Blocks are :data:`BLOCK` tokens (not the API's
default of 16, so a client using the wrong size would miss).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import pytest

from kvindex.api.config.settings import ApiSettings
from kvindex.api.http.app import create_app
from kvindex.api.http.background import BackgroundServer
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.runtime import ApiDeps
from kvindex.api.schemas import ScoreResponse
from kvindex.clients.http import (
    AsyncKvIndexClient,
    BadRequestError,
    KvIndexClient,
    NotFoundError,
    UnauthorizedError,
    UnreachableError,
)
from kvindex.indexer.domain.events import BlockStored, EventBatch, StreamId, Tier
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.ingest.ingestor import Ingestor

MODEL = "demo-model"
BLOCK = 8
PREFIX = [(7919 * i + 13) % 150_000 for i in range(4 * BLOCK)]
TAIL = [(104_729 * i + 5) % 150_000 for i in range(2 * BLOCK + 3)]
REQUEST = PREFIX + TAIL
"""6 full blocks and 3 tokens: r1 matches 4 blocks, r2 2 (3 with LoRA ``sql``)."""
TOKEN = "s3cret-token"


@dataclass
class Served:
    base_url: str
    registry: Registry


def seed(index: MemoryIndex, registry: Registry) -> None:
    """Put the fleet's blocks in through the Ingestor and mark both streams live."""
    ingestor = Ingestor(index)
    now = time.time()
    stores = {
        "r1": [BlockStored((101, 102, 103, 104), None, PREFIX, BLOCK, Tier.GPU)],
        "r2": [
            BlockStored((201, 202), None, PREFIX[: 2 * BLOCK], BLOCK, Tier.GPU),
            BlockStored((211, 212, 213), None, PREFIX[: 3 * BLOCK], BLOCK, Tier.GPU, "sql"),
        ],
    }
    for replica, events in stores.items():
        stream = StreamId(replica, 0)
        report = ingestor.apply(stream, MODEL, EventBatch(0, now, 0, events))
        assert report.applied
        report.connected, report.last_seq, report.last_event_ts = True, 0, now
        registry.record(stream, report)


@contextmanager
def serving(auth_token: str | None = None) -> Iterator[Served]:
    """The API on 127.0.0.1 (free port) in a thread; stopped and joined on exit."""
    index = MemoryIndex()
    registry = Registry((ReplicaSpec("r1", MODEL), ReplicaSpec("r2", MODEL)))
    seed(index, registry)
    settings = ApiSettings(scrape_interval_s=0, auth_token=auth_token, seed=7)
    deps = ApiDeps(
        settings=settings,
        index=index,
        registry=registry,
        loads=MemoryLoadStore(),
        blocking_store=False,
    )
    server = BackgroundServer(create_app(deps), lifespan="on").start()
    try:
        yield Served(server.base_url, registry)
    finally:
        server.stop()
    assert not server.running, "the API server did not stop"


class Blocking:
    """An :class:`AsyncKvIndexClient` driven from sync test code: each method call runs
    the coroutine to completion on one private event loop (the client's home loop)."""

    def __init__(self, client: AsyncKvIndexClient, runner: asyncio.Runner) -> None:
        self._client = client
        self._runner = runner

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method: Callable[..., Coroutine[Any, Any, Any]] = getattr(self._client, name)
        return lambda *args, **kwargs: self._runner.run(method(*args, **kwargs))


@contextmanager
def connect(mode: str, base_url: str, token: str | None = None) -> Iterator[KvIndexClient]:
    """A sync client, or an async one behind :class:`Blocking` (typed as the sync one:
    both have the same methods; ``test_client.py`` checks their signatures agree)."""
    if mode == "sync":
        with KvIndexClient(base_url, token=token, timeout_s=5) as client:
            yield client
        return
    with asyncio.Runner() as runner:
        async_client = AsyncKvIndexClient(base_url, token=token, timeout_s=5)
        try:
            yield cast(KvIndexClient, Blocking(async_client, runner))
        finally:
            runner.run(async_client.close())


@pytest.fixture
def served() -> Iterator[Served]:
    with serving() as served:
        yield served


@pytest.fixture(params=["sync", "async"])
def mode(request: pytest.FixtureRequest) -> str:
    mode: str = request.param
    return mode


@pytest.fixture
def client(mode: str, served: Served) -> Iterator[KvIndexClient]:
    with connect(mode, served.base_url) as client:
        yield client


def matched(answer: ScoreResponse) -> dict[str, int]:
    return {entry.replica: entry.matched_blocks for entry in answer.scores}


# --- probes and info --------------------------------------------------------------------


def test_probes(client: KvIndexClient) -> None:
    assert client.healthy() is True
    assert client.ready() is True


def test_stats_and_config(client: KvIndexClient) -> None:
    stats = client.stats()
    assert (stats["replicas"], stats["streams"]) == (2, 2)
    assert stats["blocks"] == {"gpu": 4 + 2 + 3, "cpu": 0, "other": 0}
    config = client.config()
    assert config["models"] == {MODEL: {"block_size": BLOCK}}
    assert config["default_policy"] == "kv_aware"


# --- scoring ------------------------------------------------------------------------------


def test_score_finds_the_longest_prefix(client: KvIndexClient) -> None:
    answer = client.score(MODEL, token_ids=REQUEST)
    assert isinstance(answer, ScoreResponse)
    assert (answer.best, answer.policy) == ("r1", "kv_aware")
    assert (answer.block_size, answer.num_blocks, answer.num_tokens) == (BLOCK, 6, len(REQUEST))
    assert matched(answer) == {"r1": 4, "r2": 2}
    assert answer.scores[0].matched_tokens == 4 * BLOCK
    assert answer.scores[0].freshness.state == "live"


@pytest.mark.parametrize("lora_name", [None, "sql"])
def test_score_tokens_equals_score(client: KvIndexClient, lora_name: str | None) -> None:
    block_size = client.config()["models"][MODEL]["block_size"]
    by_tokens = client.score(MODEL, token_ids=REQUEST, lora_name=lora_name)
    by_keys = client.score_tokens(MODEL, REQUEST, block_size=block_size, lora_name=lora_name)
    assert by_keys.best == by_tokens.best == ("r1" if lora_name is None else "r2")
    assert matched(by_keys) == matched(by_tokens)
    assert by_keys.num_blocks == by_tokens.num_blocks == 6
    # Keys carry no partial block: the server counts the tokens of full blocks only.
    assert by_keys.num_tokens == 6 * BLOCK
    assert by_tokens.num_tokens == len(REQUEST)


def test_score_with_given_keys_and_candidates(client: KvIndexClient) -> None:
    first = client.score_tokens(MODEL, REQUEST, block_size=BLOCK, candidates=["r2"])
    assert (first.best, matched(first)) == ("r2", {"r2": 2})
    session = client.score(MODEL, token_ids=REQUEST, policy="session_affinity", session="s1")
    assert session.policy == "session_affinity"
    assert (
        session.best
        == client.score(MODEL, token_ids=PREFIX, policy="session_affinity", session="s1").best
    )


def test_score_errors(client: KvIndexClient) -> None:
    with pytest.raises(NotFoundError, match=MODEL) as unknown:
        client.score("other-model", token_ids=REQUEST)
    assert (unknown.value.status, unknown.value.kind) == (404, "unknown_model")
    with pytest.raises(BadRequestError, match="exactly one") as both:
        client.score(MODEL, token_ids=REQUEST, prompt="hello")
    assert (both.value.status, both.value.kind) == (422, "invalid_request")
    with pytest.raises(BadRequestError, match="no tokenizer"):
        client.score(MODEL, prompt="hello")
    with pytest.raises(BadRequestError, match="candidates"):
        client.score(MODEL, token_ids=REQUEST, candidates=["r9"])
    with pytest.raises(BadRequestError, match="policy"):
        client.score(MODEL, token_ids=REQUEST, policy="fastest")


def test_score_tokens_with_the_wrong_block_size(client: KvIndexClient) -> None:
    # The keys say which block size they were computed for; the server refuses a mismatch.
    with pytest.raises(BadRequestError, match="block_size") as caught:
        client.score_tokens(MODEL, REQUEST, block_size=16)
    assert caught.value.status == 422


# --- load and replicas -------------------------------------------------------------------


def test_load_shows_in_replicas(client: KvIndexClient) -> None:
    client.report_load("r1", running=3, waiting=1, kv_usage=0.5)
    client.report_load("r2", 0, 0, ts=time.time() - 1)
    views = {view.id: view for view in client.replicas()}
    assert sorted(views) == ["r1", "r2"]
    r1 = views["r1"]
    assert r1.load is not None
    assert (r1.load.running, r1.load.waiting, r1.load.kv_usage) == (3, 1, 0.5)
    assert r1.load.source == "push"
    assert views["r2"].load is not None
    assert views["r2"].load.age_s >= 1
    assert r1.state == "live"
    assert [(s.rank, s.blocks["gpu"]) for s in r1.streams] == [(0, 4)]
    entries = {e.replica: e for e in client.score(MODEL, token_ids=REQUEST).scores}
    assert entries["r1"].load is not None
    assert entries["r1"].load.running == 3


def test_load_errors(client: KvIndexClient) -> None:
    with pytest.raises(BadRequestError, match="not registered"):
        client.report_load("r9", 1, 1)
    with pytest.raises(BadRequestError, match="kv_usage"):
        client.report_load("r1", 1, 1, kv_usage=2.0)


def test_add_and_remove_replica(client: KvIndexClient, served: Served) -> None:
    assert client.add_replica("r3", MODEL, url="http://127.0.0.1:9", dp_size=2) is True
    assert client.add_replica("r3", MODEL, url="http://127.0.0.1:9", dp_size=2) is False
    r3 = {view.id: view for view in client.replicas()}["r3"]
    assert (r3.url, r3.dp_size, r3.events, r3.state) == ("http://127.0.0.1:9", 2, None, "stale")
    assert served.registry.get("r3") is not None
    with pytest.raises(BadRequestError, match="dp_size"):
        client.add_replica("r4", MODEL, dp_size=0)
    client.remove_replica("r3")
    assert [view.id for view in client.replicas()] == ["r1", "r2"]
    with pytest.raises(NotFoundError, match="r3") as caught:
        client.remove_replica("r3")
    assert caught.value.kind == "unknown_replica"


# --- auth and transport -------------------------------------------------------------------


def test_auth_rejects_a_missing_or_wrong_token(mode: str) -> None:
    with serving(auth_token=TOKEN) as served:
        with connect(mode, served.base_url) as anonymous:
            assert anonymous.healthy() is True  # probes need no token
            with pytest.raises(UnauthorizedError) as caught:
                anonymous.score(MODEL, token_ids=REQUEST)
            assert (caught.value.status, caught.value.kind) == (401, "unauthorized")
            with pytest.raises(UnauthorizedError):
                anonymous.stats()
        with (
            connect(mode, served.base_url, token="wrong") as wrong,
            pytest.raises(UnauthorizedError),
        ):
            wrong.replicas()
        with connect(mode, served.base_url, token=TOKEN) as client:
            assert client.score(MODEL, token_ids=REQUEST).best == "r1"


def test_unreachable_server(mode: str) -> None:
    with socket.socket() as sock:  # bound, never listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        with connect(mode, f"http://127.0.0.1:{sock.getsockname()[1]}") as client:
            assert client.healthy() is False
            assert client.ready() is False
            with pytest.raises(UnreachableError, match="ConnectError") as caught:
                client.stats()
    assert caught.value.status is None


# --- the async client, natively -----------------------------------------------------------


def test_async_concurrent_scores(served: Served) -> None:
    async def main() -> list[ScoreResponse]:
        async with AsyncKvIndexClient(served.base_url) as client:
            assert await client.healthy()
            calls = [client.score_tokens(MODEL, REQUEST, block_size=BLOCK) for _ in range(10)]
            calls += [client.score(MODEL, token_ids=REQUEST) for _ in range(10)]
            return await asyncio.gather(*calls)

    answers = asyncio.run(main())
    assert {answer.best for answer in answers} == {"r1"}
    assert {matched(answer)["r1"] for answer in answers} == {4}
