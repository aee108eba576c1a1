"""examples/kvindex.toml: loads through both processes' loaders, shows every setting with
its default. A field added to IndexerSettings, ApiSettings, Weights, ReplicaSpec,
ModelSpec, RoutingRule, ProxySettings or PickerSettings fails here until the example shows it."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any

from kvindex.api.config.settings import ApiSettings, ModelSpec, load_api_settings
from kvindex.api.decision.policies import Weights
from kvindex.api.decision.routing_rules import RoutingRule
from kvindex.clients.picker.settings import PickerSettings, load_picker_settings
from kvindex.clients.proxy.settings import ProxySettings, load_proxy_settings
from kvindex.indexer.config.settings import IndexerSettings, load_settings, read_toml
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.fleet.settings import DiscoverySettings

EXAMPLE = Path(__file__).parents[2] / "examples" / "kvindex.toml"
_COMMENTED_KEY = re.compile(r"^# ([a-z_]+ = .*)$", re.MULTILINE)
"""``# key = value``: a setting without a default, shown with an example value."""


def field_names(kind: type) -> set[str]:
    return {f.name for f in dataclasses.fields(kind)}


def shown() -> dict[str, Any]:
    """The example with its commented-out settings uncommented (they must be valid TOML)."""
    return tomllib.loads(_COMMENTED_KEY.sub(r"\1", EXAMPLE.read_text()))


def test_the_indexer_loads_it_and_every_active_value_is_the_default() -> None:
    settings = load_settings(EXAMPLE, env={})
    (replica,) = settings.replicas
    assert replica == ReplicaSpec(
        "r1",
        "meta-llama/Llama-3.1-8B-Instruct",
        events="tcp://127.0.0.1:5557",
        replay="tcp://127.0.0.1:5558",
        url="http://127.0.0.1:8001",
    )
    assert dataclasses.replace(settings, replicas=()) == IndexerSettings()


def test_the_api_loads_it_and_every_active_value_is_the_default() -> None:
    doc = read_toml(EXAMPLE)
    settings = load_api_settings(doc["api"], doc["models"], rules=doc["rules"], env={})
    assert settings.models == (
        ModelSpec("meta-llama/Llama-3.1-8B-Instruct", block_size=16, tokenizer="replica"),
    )
    # The one active rule only applies to requests that say they are batch work.
    assert settings.rules == (RoutingRule("batch", workload=("batch",), policy="least_load"),)
    assert dataclasses.replace(settings, models=(), rules=()) == ApiSettings()


def test_the_proxy_loads_it_and_every_active_value_is_the_default() -> None:
    assert load_proxy_settings(read_toml(EXAMPLE)["proxy"], env={}) == ProxySettings()


def test_the_picker_loads_it_and_every_active_value_is_the_default() -> None:
    assert load_picker_settings(read_toml(EXAMPLE)["picker"], env={}) == PickerSettings()


def test_every_setting_of_both_processes_is_shown() -> None:
    doc = shown()
    top = set(doc) - {"api", "models", "rules", "proxy", "picker", "discovery"}
    assert field_names(DiscoverySettings) - set(doc["discovery"]) == set()
    top |= {"discovery"}  # IndexerSettings.discovery: the [discovery] table
    assert field_names(IndexerSettings) - top == set()
    assert field_names(ReplicaSpec) - set(doc["replicas"][0]) == set()
    api = doc["api"]
    assert field_names(ApiSettings) - {"models", "rules"} - set(api) == set()
    assert field_names(Weights) - set(api["weights"]) == set()
    assert field_names(ModelSpec) - set(doc["models"][0]) == set()
    assert field_names(RoutingRule) - set(doc["rules"][0]) == set()
    assert field_names(ProxySettings) - set(doc["proxy"]) == set()
    assert field_names(PickerSettings) - set(doc["picker"]) == set()
    assert set(top) - field_names(IndexerSettings) == set()  # nothing the loaders refuse


def test_the_settings_without_defaults_have_valid_examples() -> None:
    doc = shown()
    assert load_settings(overrides={k: doc[k] for k in ("bind", "default_model")}, env={})
    api = {k: v for k, v in doc["api"].items() if k not in ("weights", "auth_token_file")}
    settings = load_api_settings(api, doc["models"], rules=doc["rules"], env={})
    assert settings.auth_token == "s3cret"
    (rule,) = settings.rules
    assert (rule.headers, rule.tools, rule.weights) == (
        (("x-tenant", ("acme",)),),
        False,
        (("waiting", 0.3),),
    )
    proxy = {k: v for k, v in doc["proxy"].items() if k != "auth_token_file"}
    loaded = load_proxy_settings(proxy, env={})
    assert loaded.auth_token == "client-s3cret" and loaded.api_key_of("r1") == "vllm-s3cret"
