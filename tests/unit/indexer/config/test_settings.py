"""kvindex.indexer.config.settings: defaults, TOML < env < overrides, and errors that name the
key."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kvindex.indexer.config.settings import IndexerSettings, load_settings, replace
from kvindex.indexer.domain.errors import SettingsError
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.redis.schema import Schema

REPLICA_TOML = """
stale_after_s = 30
[[replicas]]
id = "r1"
model = "m"
events = "tcp://10.0.0.5:5557"
replay = "tcp://10.0.0.5:5558"

[api]
port = 9000

[[models]]
name = "m"
"""


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvindex.toml"
    path.write_text(text)
    return path


def test_defaults_need_nothing() -> None:
    settings = load_settings(env={})
    assert settings == IndexerSettings()
    assert (settings.store, settings.replicas, settings.purge_after_s) == ("memory", (), 0.0)


def test_the_file_gives_replicas_and_skips_the_api_sections(tmp_path: Path) -> None:
    settings = load_settings(toml(tmp_path, REPLICA_TOML), env={})
    assert settings.stale_after_s == 30.0
    (replica,) = settings.replicas
    assert (replica.id, replica.model, replica.replay) == ("r1", "m", "tcp://10.0.0.5:5558")


def test_env_beats_the_file_and_overrides_beat_env(tmp_path: Path) -> None:
    path = toml(tmp_path, 'stale_after_s = 30\nredis_prefix = "file"\n')
    env = {"KVINDEX_STALE_AFTER_S": "40", "KVINDEX_KEY_CACHE_SIZE": "128"}
    settings = load_settings(path, env=env, overrides={"stale_after_s": 50, "store": None})
    assert (settings.stale_after_s, settings.key_cache_size) == (50.0, 128)
    assert (settings.redis_prefix, settings.store) == ("file", "memory")  # None: not given


def test_the_index_groups_are_by_topology_unless_set(tmp_path: Path) -> None:
    assert IndexerSettings().redis_index_groups == 0
    assert IndexerSettings(redis_prefix="p").redis_schema == Schema("p", 0)
    path = toml(tmp_path, 'redis_prefix = "p"\nredis_index_groups = 4\n')
    assert load_settings(path, env={}).redis_schema == Schema("p", 4)
    from_env = load_settings(env={"KVINDEX_REDIS_INDEX_GROUPS": "16"})
    assert from_env.redis_schema.index_groups == 16


def test_command_line_replicas_add_to_the_files(tmp_path: Path) -> None:
    extra = (ReplicaSpec("r2", "m", events="tcp://10.0.0.6:5557"),)
    settings = load_settings(toml(tmp_path, REPLICA_TOML), env={}, extra_replicas=extra)
    assert [r.id for r in settings.replicas] == ["r1", "r2"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVINDEX_STALE_AFTER_S": "soon"}, "stale_after_s must be a number, got 'soon'"),
        ({"KVINDEX_KEY_CACHE_SIZE": "1.5"}, "key_cache_size must be an integer, got '1.5'"),
        ({"KVINDEX_PURGE_AFTER_S": "-1"}, "purge_after_s must be >= 0, got -1.0"),
        ({"KVINDEX_STORE": "sqlite"}, "store must be one of ('memory', 'redis'), got 'sqlite'"),
        ({"KVINDEX_REDIS_PREFIX": "a b"}, "redis_prefix"),
        (
            {"KVINDEX_REDIS_CLUSTER": "yes"},
            "redis_cluster must be one of ('auto', 'on', 'off'), got 'yes'",
        ),
        ({"KVINDEX_BIND": "udp://x"}, "bind"),
        (
            {"KVINDEX_REDIS_INDEX_GROUPS": "1025"},
            "redis_index_groups must be 1 to 1024 (0: by topology), got 1025",
        ),
        (
            {"KVINDEX_REDIS_INDEX_GROUPS": "-1"},
            "redis_index_groups must be 1 to 1024 (0: by topology), got -1",
        ),
    ],
)
def test_a_bad_value_names_its_key(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match="^" + re.escape(message)):
        load_settings(env=env)


def test_an_unknown_key_in_the_file_is_named(tmp_path: Path) -> None:
    path = toml(tmp_path, "stale_after = 30\n")
    with pytest.raises(SettingsError, match=r"unknown settings \['stale_after'\]"):
        load_settings(path, env={})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("replicas = 3\n", "replicas must be an array of tables"),
        ("replicas = [1]\n", r"replicas\[0\] must be a table"),
        ("stale_after_s = \n", "config file"),
    ],
)
def test_a_malformed_file_is_named(tmp_path: Path, text: str, message: str) -> None:
    path = toml(tmp_path, text)
    with pytest.raises(SettingsError, match=message) as raised:
        load_settings(path, env={})
    assert str(path) in str(raised.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"config file .*missing\.toml"):
        load_settings(tmp_path / "missing.toml", env={})


def test_duplicate_replica_ids_are_refused() -> None:
    twice = (ReplicaSpec("r1", "m", events="tcp://a:1"), ReplicaSpec("r1", "m", events="tcp://b:1"))
    with pytest.raises(SettingsError, match="duplicate ids"):
        IndexerSettings(replicas=twice)


def test_replace_validates_again() -> None:
    assert replace(IndexerSettings(), store="redis").store == "redis"
    with pytest.raises(SettingsError, match="rebuild_cooldown_s must be >= 0"):
        replace(IndexerSettings(), rebuild_cooldown_s=-5.0)


def test_a_file_replica_with_too_many_ranks_is_refused_naming_dp_size(tmp_path: Path) -> None:
    path = toml(tmp_path, '[[replicas]]\nid = "r1"\nmodel = "m"\ndp_size = 100000\n')
    with pytest.raises(SettingsError, match=r"replica r1: dp_size must be in \[1, 1024\]"):
        load_settings(path, env={})


def test_sharding_is_on_by_default_for_redis_only() -> None:
    assert IndexerSettings(store="redis").sharded
    assert not IndexerSettings().sharded
    assert not IndexerSettings(store="redis", shard="off").sharded


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVINDEX_SHARD": "maybe"}, "shard must be one of"),
        ({"KVINDEX_SHARD": "on"}, 'needs store = "redis"'),
        ({"KVINDEX_STORE": "redis", "KVINDEX_LEASE_TTL_S": "0"}, "lease_ttl_s must be > 0"),
        ({"KVINDEX_INDEXER_ID": "a/b"}, "indexer_id"),
    ],
)
def test_bad_shard_settings_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(message)):
        load_settings(env=env)


def test_an_indexer_id_comes_from_the_environment() -> None:
    settings = load_settings(env={"KVINDEX_STORE": "redis", "KVINDEX_INDEXER_ID": "idx-0"})
    assert settings.indexer_id == "idx-0"


def test_ingest_workers_default_to_one_per_two_cores_available_at_most_two(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for cores, expected in ((1, 1), (2, 1), (3, 1), (4, 2), (16, 2)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert IndexerSettings().num_ingest_workers == expected
    assert IndexerSettings(ingest_workers=8).num_ingest_workers == 8
    assert IndexerSettings(store="redis").num_ingest_workers == 1
    assert load_settings(env={"KVINDEX_INGEST_WORKERS": "3"}).num_ingest_workers == 3
    for bad in (-1, 65):
        with pytest.raises(SettingsError, match="ingest_workers must be 0"):
            IndexerSettings(ingest_workers=bad)
