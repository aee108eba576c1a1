"""kvindex.api.decision.routing_rules: each kind of condition, first-match order, table
validation."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest

from kvindex.api.config.settings import ApiSettings, ModelSpec, load_api_settings
from kvindex.api.decision.routing_rules import (
    WORKLOAD_HEADER,
    RoutingRule,
    RuleInput,
    first_match,
    rule_from_table,
)
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.schemas import ScoreRequest, ScoreResponse
from kvindex.api.score import RequestError, Scorer
from kvindex.indexer.domain.errors import SettingsError
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex

MODEL = "m"
SEEN = RuleInput(model=MODEL, num_tokens=100)
"""A request that shows nothing but its model and length."""


def rule(**conditions: Any) -> RoutingRule:
    """A rule named ``r`` choosing ``least_load`` under ``conditions`` (TOML spelling)."""
    return rule_from_table({"name": "r", "policy": "least_load", **conditions}, 1)


@pytest.mark.parametrize(
    ("conditions", "matching", "other"),
    [
        ({"model": MODEL}, SEEN, dataclasses.replace(SEEN, model="n")),
        ({"model": ["n", MODEL]}, SEEN, dataclasses.replace(SEEN, model="o")),
        (
            {"workload": "batch"},
            dataclasses.replace(SEEN, workload="batch"),
            dataclasses.replace(SEEN, workload="chat"),
        ),
        ({"workload": "batch"}, dataclasses.replace(SEEN, workload="batch"), SEEN),
        (
            {"user": ["alice", "bob"]},
            dataclasses.replace(SEEN, user="bob"),
            dataclasses.replace(SEEN, user="carol"),
        ),
        (
            {"headers": {"X-Tenant": "acme"}},
            dataclasses.replace(SEEN, headers={"x-tenant": "acme"}),
            dataclasses.replace(SEEN, headers={"x-tenant": "globex"}),
        ),
        (
            {"headers": {"x-tenant": "acme"}},
            dataclasses.replace(SEEN, headers={"x-tenant": "acme"}),
            SEEN,
        ),
        ({"min_prompt_tokens": 100}, SEEN, dataclasses.replace(SEEN, num_tokens=99)),
        ({"max_prompt_tokens": 100}, SEEN, dataclasses.replace(SEEN, num_tokens=101)),
        (
            {"min_prompt_tokens": 50, "max_prompt_tokens": 50},
            dataclasses.replace(SEEN, num_tokens=50),
            SEEN,
        ),
        ({"tools": True}, dataclasses.replace(SEEN, has_tools=True), SEEN),
        ({"tools": False}, SEEN, dataclasses.replace(SEEN, has_tools=True)),
    ],
)
def test_each_condition_matches_its_value_and_nothing_else(
    conditions: dict[str, Any], matching: RuleInput, other: RuleInput
) -> None:
    made = rule(**conditions)
    assert made.matches(matching)
    assert not made.matches(other)


def test_every_condition_of_a_rule_must_hold() -> None:
    both = rule(workload="batch", min_prompt_tokens=1000)
    assert not both.matches(dataclasses.replace(SEEN, workload="batch"))
    assert not both.matches(dataclasses.replace(SEEN, num_tokens=5000))
    assert both.matches(dataclasses.replace(SEEN, workload="batch", num_tokens=5000))


def test_a_rule_without_conditions_matches_every_request() -> None:
    assert rule().matches(SEEN)


def test_the_first_matching_rule_wins_in_configuration_order() -> None:
    long_prompts = rule_from_table(
        {"name": "long", "min_prompt_tokens": 50, "policy": "kv_aware"}, 1
    )
    batch = rule_from_table({"name": "batch", "workload": "batch", "policy": "least_load"}, 2)
    anything = rule_from_table({"name": "rest", "policy": "round_robin"}, 3)
    batch_seen = dataclasses.replace(SEEN, workload="batch")
    assert first_match((long_prompts, batch, anything), batch_seen) is long_prompts
    assert first_match((batch, long_prompts, anything), batch_seen) is batch
    short = dataclasses.replace(SEEN, num_tokens=10)
    assert first_match((long_prompts, batch, anything), short) is anything
    assert first_match((long_prompts, batch), short) is None
    assert first_match((), SEEN) is None


@pytest.mark.parametrize(
    ("table", "named"),
    [
        ({"policy": "kv_aware"}, "[[rules]] #1: every rule needs a name, got None"),
        ({"name": "r"}, "rules.r: the rule chooses neither a policy nor weights"),
        ({"name": "r", "policy": "fastest"}, "rules.r.policy must be one of"),
        ({"name": "r", "policy": "kv_aware", "colour": "red"}, "rules.r: unknown keys ['colour']"),
        ({"name": "r", "workload": 3, "policy": "kv_aware"}, "rules.r.workload must be a string"),
        ({"name": "r", "user": [], "policy": "kv_aware"}, "rules.r.user must be a string"),
        (
            {"name": "r", "headers": {"x-tenant": 1}, "policy": "kv_aware"},
            "rules.r.headers.x-tenant must be a string or a non-empty list of strings, got 1",
        ),
        ({"name": "r", "headers": "x", "policy": "kv_aware"}, "rules.r.headers must be a table"),
        (
            {"name": "r", "min_prompt_tokens": -1, "policy": "kv_aware"},
            "rules.r.min_prompt_tokens must be an integer >= 0, got -1",
        ),
        (
            {"name": "r", "max_prompt_tokens": 1.5, "policy": "kv_aware"},
            "rules.r.max_prompt_tokens must be an integer >= 0, got 1.5",
        ),
        (
            {"name": "r", "min_prompt_tokens": 10, "max_prompt_tokens": 5, "policy": "kv_aware"},
            "rules.r: min_prompt_tokens 10 is above max_prompt_tokens 5",
        ),
        (
            {"name": "r", "tools": "yes", "policy": "kv_aware"},
            "rules.r.tools must be true or false, got 'yes'",
        ),
        ({"name": "r", "weights": {"speed": 1.0}}, "rules.r.weights: unknown weights ['speed']"),
        (
            {"name": "r", "weights": {"cpu": -1.0}},
            "rules.r.weights: weight cpu must be finite and >= 0",
        ),
        ({"name": "r", "weights": [1]}, "rules.r.weights must be a table"),
    ],
)
def test_a_bad_rule_names_the_key_and_the_value(table: Mapping[str, Any], named: str) -> None:
    with pytest.raises(SettingsError) as raised:
        load_api_settings(None, None, rules=[table], env={})
    assert named in str(raised.value)


@pytest.mark.parametrize(
    "table",
    [
        {"name": "only", "policy": "kv_aware"},
        {
            "name": "every-key",
            "model": ["m", "n"],
            "workload": ["batch"],
            "user": ["alice"],
            "headers": {"x-tenant": ["acme", "globex"]},
            "min_prompt_tokens": 0,
            "max_prompt_tokens": 4096,
            "tools": False,
            "policy": "prefix_hash",
            "weights": {"waiting": 0.3, "cache": 2.0},
        },
    ],
)
def test_a_rule_shows_as_the_table_it_was_read_from(table: dict[str, Any]) -> None:
    read = rule_from_table(table, 1)
    assert read.as_table() == table
    assert rule_from_table(read.as_table(), 1) == read


def test_a_condition_given_as_one_string_shows_as_a_list() -> None:
    assert rule(workload="batch").as_table() == {
        "name": "r",
        "workload": ["batch"],
        "policy": "least_load",
    }


def test_rules_load_from_the_file_and_the_environment_in_order() -> None:
    tables: list[Mapping[str, Any]] = [
        {"name": "batch", "workload": "batch", "policy": "least_load"},
        {"name": "agents", "tools": True, "weights": {"waiting": 0.3}},
    ]
    settings = load_api_settings(None, None, rules=tables, env={})
    assert [r.name for r in settings.rules] == ["batch", "agents"]
    assert settings.rules[1].weight_overrides() == {"waiting": 0.3}
    env = {"KVINDEX_API_RULES": '[{"name": "env", "policy": "random"}]'}
    assert [r.name for r in load_api_settings(None, None, rules=tables, env=env).rules] == ["env"]
    with pytest.raises(SettingsError, match="KVINDEX_API_RULES must be a JSON array of tables"):
        load_api_settings(env={"KVINDEX_API_RULES": "{}"})
    with pytest.raises(SettingsError, match=r"rules: duplicate names in \['batch', 'batch'\]"):
        load_api_settings(None, None, rules=[tables[0], tables[0]], env={})


# --- the scorer applies the matched rule ----------------------------------------------------


def scorer(*rules: Mapping[str, Any], models: tuple[ModelSpec, ...] = ()) -> Scorer:
    registry = Registry((ReplicaSpec("a", MODEL), ReplicaSpec("b", MODEL)))
    settings = load_api_settings(None, None, rules=list(rules), env={}, overrides={"seed": 1})
    return Scorer(
        dataclasses.replace(settings, models=models),
        MemoryIndex(),
        registry,
        MemoryLoadStore(),
        tokenizers=lambda _: None,
        blocking_store=False,
    )


def answer(of: Scorer, headers: Mapping[str, str] | None = None, **fields: Any) -> ScoreResponse:
    request = ScoreRequest(model=MODEL, **({"token_ids": list(range(64))} | fields))
    return asyncio.run(of.score(request, headers))


BATCH = {"name": "batch", "workload": "batch", "policy": "least_load"}
ACME = {"name": "acme", "headers": {"x-tenant": "acme"}, "weights": {"waiting": 0.7}}
AGENTS = {"name": "agents", "tools": True, "policy": "round_robin"}
LONG = {"name": "long", "min_prompt_tokens": 1000, "policy": "prefix_hash"}


def test_the_answer_names_the_rule_and_uses_its_policy_and_weights() -> None:
    routed = scorer(BATCH, ACME, AGENTS, LONG)
    batch = answer(routed, workload="batch")
    assert (batch.rule, batch.policy) == ("batch", "least_load")
    from_header = answer(routed, {WORKLOAD_HEADER: "batch"})
    assert (from_header.rule, from_header.policy) == ("batch", "least_load")
    acme = answer(routed, {"x-tenant": "acme"})
    assert (acme.rule, acme.policy, acme.weights["waiting"]) == ("acme", "kv_aware", 0.7)
    assert answer(routed, has_tools=True).rule == "agents"
    long = answer(routed, token_ids=list(range(1000)))
    assert (long.rule, long.policy) == ("long", "prefix_hash")
    keyed = answer(routed, token_ids=None, block_keys=list(range(1, 64)))  # 63 blocks of 16 tokens
    assert (keyed.num_tokens, keyed.rule) == (1008, "long")
    plain = answer(routed)
    assert (plain.rule, plain.policy, plain.weights["waiting"]) == (None, "kv_aware", 0.1)


def test_the_request_s_own_choice_beats_the_rule_and_the_rule_beats_the_model() -> None:
    routed = scorer(ACME, BATCH, models=(ModelSpec(MODEL, policy="random"),))
    assert answer(routed).policy == "random"
    assert answer(routed, workload="batch").policy == "least_load"
    weights_only = answer(routed, {"x-tenant": "acme"})  # the rule chooses no policy
    assert (weights_only.rule, weights_only.policy) == ("acme", "random")
    chosen = answer(routed, {"x-tenant": "acme"}, policy="round_robin", weights={"waiting": 0.2})
    assert (chosen.rule, chosen.policy, chosen.weights["waiting"]) == ("acme", "round_robin", 0.2)
    assert answer(routed, workload="batch", policy="round_robin").policy == "round_robin"


def test_bad_request_weights_are_still_a_request_error_under_a_rule() -> None:
    with pytest.raises(RequestError, match="weights"):
        answer(scorer(ACME), {"x-tenant": "acme"}, weights={"speed": 1.0})


def test_settings_built_in_code_take_rules_too() -> None:
    made = RoutingRule("batch", workload=("batch",), policy="least_load")
    assert ApiSettings(rules=(made,)).rules == (made,)
    with pytest.raises(SettingsError, match=r"rules\.x\.policy"):
        RoutingRule("x", policy="fastest")
    with pytest.raises(SettingsError, match=r"rules\.x\.model must be a tuple of strings"):
        RoutingRule("x", model="llama", policy="kv_aware")  # type: ignore[arg-type]
