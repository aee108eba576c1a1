"""``api.dynamo_dump``: the memory index with a journal, on ``kvindex serve`` only."""

from __future__ import annotations

import pytest

from kvindex.api.config.settings import ApiSettings
from kvindex.api.http.server import dump_index
from kvindex.indexer.config.settings import IndexerSettings
from kvindex.indexer.domain.errors import SettingsError
from kvindex.indexer.index.block_journal import JournaledIndex


def test_the_journal_is_kept_only_when_asked_and_only_in_memory() -> None:
    memory, dump = IndexerSettings(), ApiSettings(dynamo_dump=True)
    assert dump_index(memory, ApiSettings()) is None
    assert isinstance(dump_index(memory, dump), JournaledIndex)
    with pytest.raises(SettingsError, match="memory store"):
        dump_index(IndexerSettings(store="redis", redis_url="redis://127.0.0.1:1/0"), dump)
