"""The [discovery] table: file < env < command line, and every bad value named by its key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvindex.indexer.config.discovery import load_discovery_settings
from kvindex.indexer.config.settings import load_settings
from kvindex.indexer.domain.errors import SettingsError
from kvindex.indexer.fleet.pod_watch import DiscoveryError, api_client, own_namespace
from kvindex.indexer.fleet.settings import DiscoverySettings


def test_off_by_default_and_read_from_the_file_env_and_command_line(tmp_path: Path) -> None:
    assert not load_settings(env={}).discovery.enabled
    config = tmp_path / "kvindex.toml"
    config.write_text('[discovery]\npool = "from-file"\nmodel = "m"\n')
    assert load_settings(config, env={}).discovery == DiscoverySettings(pool="from-file", model="m")
    env = {"KVINDEX_DISCOVERY_POOL": "from-env", "KVINDEX_DISCOVERY_NAMESPACE": "ns"}
    settings = load_settings(config, env=env)
    assert settings.discovery == DiscoverySettings(pool="from-env", namespace="ns", model="m")
    cli = {"pool": None, "selector": "app=vllm", "ports": (8000, 8001), "model": None}
    with pytest.raises(SettingsError, match="exclude each other"):
        load_settings(config, env=env, discovery=cli)
    env = {"KVINDEX_DISCOVERY_SELECTOR": "app=x", "KVINDEX_DISCOVERY_PORTS": "8000,8001"}
    assert load_settings(env=env).discovery.ports == (8000, 8001)


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"pool": "p", "selector": "a=b"}, "exclude each other"),
        ({"selector": "a=b"}, "discovery.selector needs 1 to 8 discovery.ports"),
        ({"selector": "a=b", "ports": list(range(8000, 8009))}, "1 to 8"),
        ({"selector": "a=b", "ports": [8000, 8000]}, "distinct"),
        ({"selector": "a=b", "ports": [0]}, "discovery.ports must be ports"),
        ({"selector": "a=b", "ports": ["http"]}, "discovery.ports must be ports"),
        ({"pool": "p", "ports": [8000]}, "go with discovery.selector"),
        ({"pool": "Not_A_Name"}, "discovery.pool must be a Kubernetes name"),
        ({"pool": "p", "namespace": "a/b"}, "discovery.namespace must be a DNS label"),
        ({"model": "m"}, "needs discovery.pool or discovery.selector"),
        ({"pool": 3}, "discovery.pool must be a string"),
        ({"pol": "p"}, "unknown settings \\['pol'\\]"),
    ],
)
def test_a_bad_value_is_named(values: dict[str, Any], named: str) -> None:
    with pytest.raises(SettingsError, match=named):
        load_discovery_settings(values, env={})


def test_a_bad_variable_is_named() -> None:
    with pytest.raises(SettingsError, match="KVINDEX_DISCOVERY_POOLS: no such discovery setting"):
        load_discovery_settings(None, env={"KVINDEX_DISCOVERY_POOLS": "p"})
    with pytest.raises(SettingsError, match=r"\[discovery\] must be a table"):
        load_discovery_settings("p", env={})


def test_the_namespace_defaults_to_the_service_accounts(tmp_path: Path) -> None:
    (tmp_path / "namespace").write_text("inference\n")
    assert own_namespace(tmp_path / "namespace") == "inference"
    assert own_namespace(tmp_path / "absent") == "default"


def test_an_unreadable_kubeconfig_stops_the_start_with_its_reason(tmp_path: Path) -> None:
    settings = DiscoverySettings(pool="p", kubeconfig=str(tmp_path / "absent"))
    with pytest.raises(DiscoveryError, match="no usable Kubernetes config"):
        api_client(settings)


def test_in_a_pod_the_service_account_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """No kubeconfig and KUBERNETES_SERVICE_HOST set: the in-cluster config (here its token
    file is missing, and the error says so)."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(DiscoveryError, match=r"(?i)token"):
        api_client(DiscoverySettings(pool="p"))
