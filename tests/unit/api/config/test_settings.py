"""kvindex.api.config.settings: defaults, validation (errors name the key), TOML, env, overrides."""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from kvindex.api.config.settings import ApiSettings, ModelSpec, load_api_settings
from kvindex.api.decision.policies import Weights
from kvindex.indexer.domain.errors import SettingsError

MODEL = "meta-llama/Llama-3.1-8B-Instruct"

TOML = f"""
[api]
port = 9000
default_policy = "least_load"
seed = 3

[api.weights]
waiting = 0.5
prefix_blocks = 4

[[models]]
name = "{MODEL}"
block_size = 32
policy = "prefix_hash"
tokenizer = "replica"

[[models]]
name = "other"
"""


def from_toml(text: str, **kw: Any) -> ApiSettings:
    doc = tomllib.loads(text)
    return load_api_settings(doc.get("api"), doc.get("models"), env={}, **kw)


def test_every_field_has_a_usable_default() -> None:
    settings = load_api_settings(env={})
    assert settings == ApiSettings()
    assert (settings.host, settings.port, settings.auth_token) == ("127.0.0.1", 8000, None)
    assert (settings.default_policy, settings.default_block_size) == ("kv_aware", 16)
    assert settings.weights == Weights()
    assert settings.models == ()


def test_toml_tables_are_read() -> None:
    settings = from_toml(TOML)
    assert (settings.port, settings.default_policy, settings.seed) == (9000, "least_load", 3)
    assert (settings.weights.waiting, settings.weights.prefix_blocks) == (0.5, 4)
    assert settings.weights.cpu == Weights().cpu
    assert settings.models == (
        ModelSpec(MODEL, block_size=32, policy="prefix_hash", tokenizer="replica"),
        ModelSpec("other"),
    )


def test_model_lookup_by_name() -> None:
    settings = from_toml(TOML)
    spec = settings.model(MODEL)
    assert spec is not None and spec.block_size == 32
    assert settings.model("unknown") is None


def test_overrides_win_and_none_overrides_are_ignored() -> None:
    settings = from_toml(TOML, overrides={"port": 9100, "host": None})
    assert (settings.port, settings.host) == (9100, "127.0.0.1")


def test_token_comes_from_the_environment() -> None:
    settings = load_api_settings({"auth_token": "from-file"}, env={"KVINDEX_API_TOKEN": "s3cret"})
    assert settings.auth_token == "s3cret"
    assert load_api_settings({"auth_token": "from-file"}, env={}).auth_token == "from-file"
    assert load_api_settings(env={"KVINDEX_API_TOKEN": ""}).auth_token is None


def test_replica_networks_come_from_a_toml_array() -> None:
    settings = from_toml('[api]\nreplica_networks = ["10.0.0.0/8", "fd00::/8"]\n')
    assert settings.replica_networks == ("10.0.0.0/8", "fd00::/8")
    assert [str(n) for n in settings.url_policy().networks] == ["10.0.0.0/8", "fd00::/8"]


def test_a_token_file_replaces_the_token(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("  from-a-file\n")
    env = {"KVINDEX_API_TOKEN": "s3cret", "KVINDEX_API_TOKEN_FILE": str(token_file)}
    assert load_api_settings(env=env).auth_token == "from-a-file"
    by_flag = load_api_settings(env={}, overrides={"auth_token_file": token_file})
    assert (by_flag.auth_token, by_flag.auth_token_file) == ("from-a-file", str(token_file))
    in_toml = load_api_settings({"auth_token_file": str(token_file)}, env={})
    assert in_toml.auth_token == "from-a-file"


def test_a_missing_or_empty_token_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"api\.auth_token_file .*missing: No such file"):
        load_api_settings(env={"KVINDEX_API_TOKEN_FILE": str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SettingsError, match="the file is empty"):
        load_api_settings(env={}, overrides={"auth_token_file": tmp_path / "empty"})


def test_settings_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ApiSettings().port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("api", "named"),
    [
        ({"prot": 8000}, "unknown settings ['prot']"),
        ({"default_policy": "fastest"}, "api.default_policy must be one of"),
        ({"default_block_size": 0}, "api.default_block_size must be an integer > 0, got 0"),
        ({"port": 70_000}, "api.port must be an integer in [0, 65535], got 70000"),
        ({"port": "8000"}, "api.port must be an integer in [0, 65535], got '8000'"),
        ({"scrape_interval_s": -1.0}, "api.scrape_interval_s must be a finite number >= 0"),
        ({"scrape_timeout_s": 0}, "api.scrape_timeout_s must be a finite number > 0, got 0"),
        ({"tokenizer_cache_entries": -1}, "api.tokenizer_cache_entries must be an integer >= 0"),
        ({"max_body_bytes": 0}, "api.max_body_bytes must be an integer > 0, got 0"),
        ({"body_timeout_s": 0}, "api.body_timeout_s must be a finite number > 0, got 0"),
        ({"replica_networks": ["10.0.0.0/33"]}, "api.replica_networks: "),
        ({"replica_networks": "10.0.0.0/8"}, "api.replica_networks must be a list of CIDRs"),
        ({"redis_timeout_s": 0}, "api.redis_timeout_s must be a finite number > 0, got 0"),
        ({"redis_cooldown_s": -1}, "api.redis_cooldown_s must be a finite number > 0, got -1"),
        ({"default_top_k": -1}, "api.default_top_k must be an integer >= 0, got -1"),
        ({"default_top_k": 2.5}, "api.default_top_k must be an integer >= 0, got 2.5"),
        ({"weights": {"speed": 1.0}}, "unknown weights ['speed']"),
        ({"weights": {"cpu": -1.0}}, "weight cpu must be finite and >= 0, got -1.0"),
        ({"weights": {"prefix_blocks": 1.5}}, "weight prefix_blocks must be a whole number"),
    ],
)
def test_bad_api_setting_names_the_key(api: dict[str, Any], named: str) -> None:
    with pytest.raises(SettingsError) as raised:
        load_api_settings(api, env={})
    assert named in str(raised.value)


@pytest.mark.parametrize(
    ("models", "named"),
    [
        ([{"block_size": 16}], "every model needs a name"),
        ([{"name": "m", "block_size": 0}], "models.m.block_size must be an integer > 0, got 0"),
        ([{"name": "m", "block_size": 16.0}], "models.m.block_size must be an integer > 0"),
        ([{"name": "m", "policy": "fastest"}], "models.m.policy must be one of"),
        ([{"name": "m", "colour": "red"}], "'colour'"),
        ([{"name": "m"}, {"name": "m"}], "models: duplicate names in ['m', 'm']"),
    ],
)
def test_bad_model_setting_names_the_key(models: list[Mapping[str, Any]], named: str) -> None:
    with pytest.raises(SettingsError) as raised:
        load_api_settings(None, models, env={})
    assert named in str(raised.value)


# --- every setting from the environment ----------------------------------------------------


def test_every_scalar_setting_is_read_from_its_variable_with_its_type() -> None:
    env = {
        "KVINDEX_API_HOST": "0.0.0.0",
        "KVINDEX_API_PORT": "9100",
        "KVINDEX_API_SCRAPE_INTERVAL_S": "0.5",
        "KVINDEX_API_SEED": "7",
        "KVINDEX_API_REPLICA_NETWORKS": "10.0.0.0/8, fd00::/8",
        "KVINDEX_API_DEFAULT_POLICY": "least_load",
    }
    settings = load_api_settings(env=env)
    assert (settings.host, settings.port, settings.seed) == ("0.0.0.0", 9100, 7)
    assert settings.scrape_interval_s == 0.5
    assert settings.replica_networks == ("10.0.0.0/8", "fd00::/8")
    assert settings.default_policy == "least_load"


def test_every_field_has_a_variable() -> None:
    env = {
        "KVINDEX_API_" + f.name.upper(): "1"
        for f in dataclasses.fields(ApiSettings)
        if f.type in ("int", "float", "int | None")
    }
    settings = load_api_settings(env=env)
    for name in env:
        assert getattr(settings, name.removeprefix("KVINDEX_API_").lower()) == 1, name


def test_weights_and_models_come_from_their_variables() -> None:
    env = {
        "KVINDEX_API_WEIGHTS_WAITING": "0.75",
        "KVINDEX_API_WEIGHTS_PREFIX_BLOCKS": "3",
        "KVINDEX_API_MODELS": f'[{{"name": "{MODEL}", "block_size": 32}}]',
    }
    settings = load_api_settings(env=env)
    assert (settings.weights.waiting, settings.weights.prefix_blocks) == (0.75, 3)
    assert settings.weights.cpu == Weights().cpu
    assert settings.models == (ModelSpec(MODEL, block_size=32),)


def test_precedence_is_command_line_then_env_then_toml() -> None:
    doc = tomllib.loads(TOML)
    env = {"KVINDEX_API_PORT": "9100", "KVINDEX_API_WEIGHTS_WAITING": "0.9"}
    from_env = load_api_settings(doc["api"], doc["models"], env=env)
    assert (from_env.port, from_env.weights.waiting) == (9100, 0.9)
    assert from_env.weights.prefix_blocks == 4  # the TOML weight no variable replaces
    assert from_env.default_policy == "least_load"
    given = load_api_settings(doc["api"], doc["models"], env=env, overrides={"port": 9200})
    assert given.port == 9200


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("KVINDEX_API_PORT", "eighty", "KVINDEX_API_PORT must be an integer, got 'eighty'"),
        ("KVINDEX_API_BODY_TIMEOUT_S", "soon", "KVINDEX_API_BODY_TIMEOUT_S must be a number"),
        ("KVINDEX_API_PORT", "70000", "(set by KVINDEX_API_PORT)"),
        ("KVINDEX_API_REPLICA_NETWORKS", "10.0.0.0/99", "(set by KVINDEX_API_REPLICA_NETWORKS)"),
        ("KVINDEX_API_WEIGHTS_WAITNIG", "1", "KVINDEX_API_WEIGHTS_WAITNIG: no such weight"),
        ("KVINDEX_API_WEIGHTS_WAITING", "lots", "KVINDEX_API_WEIGHTS_WAITING must be a number"),
        ("KVINDEX_API_PROT", "9000", "KVINDEX_API_PROT: no such API setting"),
        ("KVINDEX_API_MODELS", "llama", "KVINDEX_API_MODELS must be a JSON array"),
    ],
)
def test_a_bad_variable_is_named_with_its_value(variable: str, value: str, says: str) -> None:
    with pytest.raises(SettingsError) as raised:
        load_api_settings(env={variable: value})
    assert says in str(raised.value)
    assert variable in str(raised.value)


def test_the_full_token_variable_wins_over_its_older_alias() -> None:
    env = {"KVINDEX_API_TOKEN": "old", "KVINDEX_API_AUTH_TOKEN": "new"}
    assert load_api_settings(env=env).auth_token == "new"
    assert load_api_settings(env={"KVINDEX_API_TOKEN": "old"}).auth_token == "old"
