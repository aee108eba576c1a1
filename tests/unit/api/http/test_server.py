"""``api.dynamo_dump``: the memory index with a journal, on ``kvindex serve`` only; what a
server does to the garbage collector once it listens."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
import uvicorn

from kvindex.api.config.settings import ApiSettings
from kvindex.api.http.server import GC_THRESHOLDS, GracefulServer, dump_index
from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.domain.errors import SettingsError
from kvindex.indexer.index.block_journal import JournaledIndex


def test_the_journal_is_kept_only_when_asked_and_only_in_memory() -> None:
    memory, dump = IndexerSettings(), ApiSettings(dynamo_dump=True)
    assert dump_index(memory, ApiSettings()) is None
    assert isinstance(dump_index(memory, dump), JournaledIndex)
    with pytest.raises(SettingsError, match="memory store"):
        dump_index(IndexerSettings(store="redis", redis_url="redis://127.0.0.1:1/0"), dump)


def test_a_listening_server_freezes_its_start_up_and_collects_less_often() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:  # never called
        raise AssertionError(scope)

    server = GracefulServer(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off"))
    before = gc.get_threshold()

    async def run() -> tuple[tuple[int, int, int], int]:
        serving = asyncio.create_task(server.serve())
        for _ in range(500):
            if server.started or serving.done():
                break
            await asyncio.sleep(0.01)
        seen = gc.get_threshold(), gc.get_freeze_count()
        server.should_exit = True
        await asyncio.wait_for(serving, 5)
        return seen

    try:
        thresholds, frozen = asyncio.run(run())
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
    assert thresholds == GC_THRESHOLDS
    assert frozen > 0
