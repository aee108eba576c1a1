"""The ``[proxy]`` table: file < env < command line, errors that name the key, no secret shown."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvindex.clients.proxy.settings import ProxySettings, load_proxy_settings
from kvindex.indexer.domain.errors import SettingsError


def test_file_then_env_then_command_line() -> None:
    table = {"max_attempts": 5, "stream_idle_timeout_s": 7, "connect_timeout_s": 1.5}
    env = {"KVINDEX_PROXY_MAX_ATTEMPTS": "4", "KVINDEX_PROXY_STREAM_IDLE_TIMEOUT_S": "9.5"}
    loaded = load_proxy_settings(table, env=env, overrides={"max_attempts": 2, "port": None})
    assert loaded.max_attempts == 2  # the command line wins
    assert loaded.stream_idle_timeout_s == 9.5  # the env over the file
    assert loaded.connect_timeout_s == 1.5  # the file over the default
    assert loaded.total_timeout_s == ProxySettings().total_timeout_s


def test_unknown_keys_and_variables_and_bad_values_are_named() -> None:
    with pytest.raises(SettingsError, match=re.escape("[proxy]: unknown settings ['max_atempts']")):
        load_proxy_settings({"max_atempts": 2}, env={})
    with pytest.raises(SettingsError, match="KVINDEX_PROXY_NOPE: no such proxy setting"):
        load_proxy_settings(env={"KVINDEX_PROXY_NOPE": "1"})
    with pytest.raises(SettingsError, match="KVINDEX_PROXY_MAX_ATTEMPTS must be an integer"):
        load_proxy_settings(env={"KVINDEX_PROXY_MAX_ATTEMPTS": "many"})
    with pytest.raises(SettingsError, match=re.escape("proxy.retry_backoff_s must be a finite")):
        load_proxy_settings({"retry_backoff_s": -1}, env={})
    blamed = "proxy.max_attempts must be an integer >= 1, got 0 (set by KVINDEX_PROXY_MAX_ATTEMPTS)"
    with pytest.raises(SettingsError, match=re.escape(blamed)):
        load_proxy_settings(env={"KVINDEX_PROXY_MAX_ATTEMPTS": "0"})
    with pytest.raises(SettingsError, match=re.escape("[proxy] must be a table")):
        load_proxy_settings(3, env={})  # type: ignore[arg-type]
    assert load_proxy_settings({"retry_backoff_s": 0}, env={}).retry_backoff_s == 0
    with pytest.raises(SettingsError, match=re.escape("proxy.workers must be an integer >= 1")):
        load_proxy_settings({"workers": 0}, env={})
    assert load_proxy_settings(env={"KVINDEX_PROXY_WORKERS": "2"}).workers == 2


def test_tokens_and_keys_from_file_env_or_token_file_and_never_shown(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file\n")
    env = {
        "KVINDEX_PROXY_AUTH_TOKEN": "from-env",
        "KVINDEX_PROXY_UPSTREAM_API_KEY": "vllm-key",
        "KVINDEX_PROXY_REPLICA_API_KEYS": '{"r2": "r2-key"}',
    }
    loaded = load_proxy_settings({"auth_token": "in-toml"}, env=env)
    assert loaded.auth_token == "from-env"
    assert loaded.api_key_of("r1") == "vllm-key" and loaded.api_key_of("r2") == "r2-key"
    assert all(secret not in repr(loaded) for secret in ("from-env", "vllm-key", "r2-key"))
    by_file = load_proxy_settings(env=env, overrides={"auth_token_file": token_file})
    assert by_file.auth_token == "from-the-file"
    with pytest.raises(SettingsError, match=r"proxy\.auth_token_file .*missing"):
        load_proxy_settings(env={}, overrides={"auth_token_file": tmp_path / "missing"})
    with pytest.raises(SettingsError, match="must be a JSON object") as bad:
        load_proxy_settings(env={"KVINDEX_PROXY_REPLICA_API_KEYS": "r1=hidden"})
    assert "hidden" not in str(bad.value)
    with pytest.raises(SettingsError, match="replica_api_keys must be a table") as bad:
        load_proxy_settings({"replica_api_keys": {"r1": 12345}}, env={})
    assert "12345" not in str(bad.value)
    assert load_proxy_settings(env={}).api_key_of("r1") is None


def test_extra_routes_are_plain_v1_paths_from_the_file_or_env() -> None:
    routes = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
    assert load_proxy_settings({"extra_routes": list(routes)}, env={}).extra_routes == routes
    env = {"KVINDEX_PROXY_EXTRA_ROUTES": "/v1/load_lora_adapter, /v1/unload_lora_adapter"}
    assert load_proxy_settings(env=env).extra_routes == routes
    assert load_proxy_settings({"extra_routes": ["/tokenize"]}, env={}).extra_routes == (
        "/tokenize",
    )
    own = ("/metrics", "/v1/models", "/v1/chat/completions", "/health")
    for bad in ("/v1/../tokenize", "/v1//x", "/v1/a/", "/v1/%2e%2e", "/v1/a\\b", *own):
        with pytest.raises(SettingsError, match=re.escape("proxy.extra_routes")):
            load_proxy_settings({"extra_routes": [bad]}, env={})


def test_the_clients_authorization_goes_on_only_when_told_and_never_with_a_token() -> None:
    assert not ProxySettings().forward_client_authorization
    env = {"KVINDEX_PROXY_FORWARD_CLIENT_AUTHORIZATION": "true"}
    assert load_proxy_settings(env=env).forward_client_authorization
    with pytest.raises(SettingsError, match="would send the proxy's own auth_token"):
        load_proxy_settings({"auth_token": "t"}, env=env)


def test_the_verdict_rule_is_whole_numbers_with_the_limit_inside_the_window() -> None:
    settings = load_proxy_settings({"verdict_window": 4, "over_predicted_limit": 4}, env={})
    assert (settings.verdict_window, settings.over_predicted_limit) == (4, 4)
    with pytest.raises(SettingsError, match=r"over_predicted_limit \(5\) must be at most"):
        load_proxy_settings({"verdict_window": 4, "over_predicted_limit": 5}, env={})
    with pytest.raises(SettingsError, match="KVINDEX_PROXY_EXACT_TO_TRUST"):
        load_proxy_settings(env={"KVINDEX_PROXY_EXACT_TO_TRUST": "0"})


@pytest.mark.parametrize(
    "name",
    ["journal_entries", "journal_candidates", "journal_stream_maxlen", "journal_token_bytes"],
)
@pytest.mark.parametrize("value", [-1, 1.5, True, "10"])
def test_journal_bounds_are_whole_numbers_at_least_zero(name: str, value: object) -> None:
    with pytest.raises(SettingsError, match=f"proxy.{name} must be an integer >= 0"):
        ProxySettings(**{name: value})  # type: ignore[arg-type]


def test_head_first_is_on_unless_turned_off_and_only_a_boolean() -> None:
    assert ProxySettings().head_first
    assert not load_proxy_settings(env={"KVINDEX_PROXY_HEAD_FIRST": "false"}).head_first
    with pytest.raises(SettingsError, match=re.escape("proxy.head_first must be true or false")):
        load_proxy_settings({"head_first": "yes"}, env={})
