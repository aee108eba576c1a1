"""``key_cache_size``: its default follows the store (a cache saves round trips to Redis; in
memory the index answers as fast, so a cache would only hold memory), a set value is kept."""

from __future__ import annotations

import pytest

from kvindex.indexer.config.settings import IndexerSettings, load_settings
from kvindex.indexer.domain.errors import SettingsError


def test_the_default_caches_on_redis_and_keeps_only_the_last_batches_in_memory() -> None:
    assert IndexerSettings(store="redis").key_cache_entries == 65_536
    assert IndexerSettings(store="memory").key_cache_entries == 0


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_a_size_given_is_used_on_either_store(store: str) -> None:
    settings = load_settings(env={"KVINDEX_KEY_CACHE_SIZE": "512"}, overrides={"store": store})
    assert settings.key_cache_entries == 512


def test_a_size_below_minus_one_names_the_key() -> None:
    with pytest.raises(SettingsError, match="key_cache_size must be >= -1, got -2"):
        IndexerSettings(key_cache_size=-2)
