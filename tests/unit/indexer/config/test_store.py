"""kvindex.indexer.config.store: the store keys, loaded alone with the indexer's layers."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvindex.indexer.config.loading import ConfigFile
from kvindex.indexer.config.settings import IndexerSettings, load_store_settings
from kvindex.indexer.config.store import StoreSettings
from kvindex.indexer.domain.errors import SettingsError


def test_file_env_and_overrides_layer_as_for_the_indexer(tmp_path: Path) -> None:
    path = tmp_path / "kvindex.toml"
    path.write_text('redis_prefix = "file"\nstale_after_s = 7\nbind = "tcp://0.0.0.0:1"\n')
    env = {"KVINDEX_REDIS_PREFIX": "env", "KVINDEX_INGEST_WORKERS": "not read"}
    settings = load_store_settings(ConfigFile.read(path), env=env, overrides={"store": "redis"})
    assert settings == StoreSettings(store="redis", redis_prefix="env", stale_after_s=7.0)


def test_the_indexer_settings_are_store_settings() -> None:
    settings = IndexerSettings(store="redis", redis_prefix="p")
    assert isinstance(settings, StoreSettings)
    assert settings.redis_schema == StoreSettings(store="redis", redis_prefix="p").redis_schema


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVINDEX_STORE": "disk"}, "store must be one of"),
        ({"KVINDEX_STALE_AFTER_S": "-1"}, "stale_after_s must be >= 0"),
        ({"KVINDEX_REDIS_INDEX_GROUPS": "2000"}, "redis_index_groups must be 1 to"),
    ],
)
def test_a_bad_value_names_its_key(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_store_settings(env=env)


def test_several_seed_urls_are_a_clusters_and_errors_hide_credentials() -> None:
    seeds = "redis://:pw@a:7000/0, redis://:pw@b:7001/0"
    assert StoreSettings(store="redis", redis_url=seeds).redis_url == seeds
    with pytest.raises(SettingsError, match="several URLs") as off:
        StoreSettings(store="redis", redis_url=seeds, redis_cluster="off")
    with pytest.raises(SettingsError, match="redis://") as scheme:
        StoreSettings(store="redis", redis_url="redis://:pw@a:7000, http://:pw@b:1")
    assert "pw" not in str(off.value) + str(scheme.value)
