"""The HTTP API over each store: routes → scorer → index filled by the real ingest path.

Tests that involve the index run on the in-process store and on a ``RedisIndex`` over the
private redis-server (the ``stores`` fixture); request-validation, OpenAPI and auth tests run
once (``MEMORY_ONLY``). Requests go through ``httpx.ASGITransport`` (no sockets).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from kvindex.api.config.settings import ApiSettings, ModelSpec
from kvindex.api.decision.policies import Weights
from kvindex.api.decision.routing_rules import RoutingRule, rule_from_table
from kvindex.api.http.app import create_app
from kvindex.api.load.store import LoadStore, MemoryLoadStore, RedisLoadStore
from kvindex.api.runtime import ApiDeps
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.domain.keys import block_keys
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import BlockIndex
from kvindex.indexer.index.redis import RedisIndex
from kvindex.indexer.redis.connection import connect
from kvindex.indexer.redis.schema import Schema
from tests.integration.api_harness import (
    BASE_URL,
    BLOCK,
    MODEL,
    Api,
    Fleet,
    entry,
    matched,
    open_api,
    tokens,
)
from tests.integration.harness import wait_until
from tests.support.redis_server import RedisServer

SETTINGS = ApiSettings(scrape_interval_s=0, seed=7)
W = Weights()
SYSTEM = tokens(1_000, 4)
"""A shared system prompt: 4 blocks."""
USER = tokens(50_000, 2, tail=5)
"""A user turn: 2 full blocks and a partial one."""
OTHER = tokens(90_000, 4)
IDLE = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
LOADED = {"running": 10.0, "waiting": 4.0, "kv_usage": 1.0}
LOADED_PENALTY = W.waiting * 4.0 + W.running * 10.0 + W.kv_usage * 1.0
"""The load term of LOADED with the default weights (0.8), before recency."""
MEMORY_ONLY = pytest.mark.parametrize("stores", ["memory"], indirect=True)


@dataclass
class Stores:
    index: BlockIndex
    loads: LoadStore
    blocking: bool


@pytest.fixture(params=["memory", "redis"])
def stores(request: pytest.FixtureRequest) -> Stores:
    """Empty index and load stores: in-process, or on the private redis-server."""
    if request.param == "memory":
        return Stores(MemoryIndex(), MemoryLoadStore(), blocking=False)
    client: redis.Redis = request.getfixturevalue("redis_client")  # flushed; closed by it
    return Stores(RedisIndex(client, Schema("api")), RedisLoadStore(client, Schema("api")), True)


ApiFactory = Callable[[ApiSettings], Api]


@pytest.fixture
def make_api(stores: Stores) -> Iterator[ApiFactory]:
    """Apps over the same stores (each with its own registry); closed after the test."""
    made: list[Api] = []

    def make(settings: ApiSettings) -> Api:
        made.append(open_api(settings, stores.index, stores.loads, blocking_store=stores.blocking))
        return made[-1]

    yield make
    for api in made:
        api.close()


@pytest.fixture
def api(make_api: ApiFactory) -> Api:
    return make_api(SETTINGS)


def error_of(response: httpx.Response, status: int) -> str:
    """The error detail of a response that must have ``status``."""
    assert response.status_code == status, response.text
    body: dict[str, str] = response.json()
    return body["detail"]


# --- 1. matching ----------------------------------------------------------------------------


def test_shared_system_prompt_is_matched_where_it_is_cached(api: Api) -> None:
    api.fleet.add("r1", "r2", "r3")
    api.fleet.store("r1", SYSTEM)
    api.fleet.store("r2", OTHER)
    answer = api.score(token_ids=SYSTEM + USER)
    assert answer.best == "r1"
    assert matched(answer) == {"r1": 4, "r2": 0, "r3": 0}
    assert (answer.num_blocks, answer.num_tokens, answer.block_size) == (6, 6 * BLOCK + 5, BLOCK)
    r1 = entry(answer, "r1")
    assert r1.matched_tokens == 4 * BLOCK
    assert r1.tiers == {"gpu": 4, "cpu": 0, "other": 0}
    assert r1.terms["cache"] == pytest.approx(W.cache * 4 / 6)


def test_request_longer_than_the_cache_matches_the_cached_blocks(api: Api) -> None:
    conversation = tokens(1_000, 10)
    api.fleet.add("short", "long")
    api.fleet.store("short", conversation[: 3 * BLOCK])
    api.fleet.store("long", conversation[: 7 * BLOCK])
    answer = api.score(token_ids=conversation)
    assert answer.best == "long"
    assert matched(answer) == {"short": 3, "long": 7}
    assert entry(answer, "short").terms["cache"] == pytest.approx(0.3)


def test_request_diverging_after_n_blocks_matches_n_blocks(api: Api) -> None:
    cached = tokens(1_000, 8)
    api.fleet.add("r1")
    api.fleet.store("r1", cached)
    diverging = cached[: 5 * BLOCK] + tokens(70_000, 3)
    assert matched(api.score(token_ids=diverging)) == {"r1": 5}
    one_token_off = list(cached)
    one_token_off[2 * BLOCK + 7] += 1  # inside the third block
    assert matched(api.score(token_ids=one_token_off)) == {"r1": 2}


def test_lora_request_matches_only_blocks_of_its_adapter(api: Api) -> None:
    api.fleet.add("plain", "sql", "chat")
    api.fleet.store("plain", SYSTEM)
    for replica, lora in (("sql", "sql-lora"), ("chat", "chat-lora")):
        # vLLM publishes the LoRA name as the extra key of every block.
        api.fleet.store(replica, SYSTEM, lora_name=lora, extra_keys=[(lora,)] * 4)
    sql = api.score(token_ids=SYSTEM, lora_name="sql-lora")
    assert sql.best == "sql"
    assert matched(sql) == {"plain": 0, "sql": 4, "chat": 0}
    assert matched(api.score(token_ids=SYSTEM)) == {"plain": 4, "sql": 0, "chat": 0}
    unknown = api.score(token_ids=SYSTEM, lora_name="other-lora")
    assert matched(unknown) == {"plain": 0, "sql": 0, "chat": 0}


def test_salted_request_matches_only_blocks_with_its_salt(api: Api) -> None:
    api.fleet.add("plain", "tenant-a", "tenant-b")
    api.fleet.store("plain", SYSTEM)
    for salt in ("tenant-a", "tenant-b"):
        # vLLM puts the cache salt in the first block's extra keys only.
        api.fleet.store(salt, SYSTEM, extra_keys=[(salt,), None, None, None])
    salted = api.score(token_ids=SYSTEM, cache_salt="tenant-a")
    assert salted.best == "tenant-a"
    assert matched(salted) == {"plain": 0, "tenant-a": 4, "tenant-b": 0}
    assert matched(api.score(token_ids=SYSTEM)) == {"plain": 4, "tenant-a": 0, "tenant-b": 0}


def test_lora_and_salt_together_match_blocks_with_both(api: Api) -> None:
    api.fleet.add("both", "lora-only")
    both = [("sql-lora", "tenant-a"), ("sql-lora",), ("sql-lora",), ("sql-lora",)]
    api.fleet.store("both", SYSTEM, lora_name="sql-lora", extra_keys=both)
    api.fleet.store("lora-only", SYSTEM, lora_name="sql-lora", extra_keys=[("sql-lora",)] * 4)
    answer = api.score(token_ids=SYSTEM, lora_name="sql-lora", cache_salt="tenant-a")
    assert matched(answer) == {"both": 4, "lora-only": 0}


def test_cpu_only_blocks_earn_the_cpu_credit(api: Api) -> None:
    api.fleet.add("r1")
    api.fleet.store("r1", SYSTEM, tier=Tier.CPU)
    answer = api.score(token_ids=SYSTEM + tokens(60_000, 1))
    r1 = entry(answer, "r1")
    assert r1.tiers == {"gpu": 0, "cpu": 4, "other": 0}
    assert r1.terms["cache"] == pytest.approx(W.cache * W.cpu * 4 / 5)


def test_gpu_beats_cpu_for_the_same_prefix(api: Api) -> None:
    api.fleet.add("gpu", "cpu", "both")
    api.fleet.store("gpu", SYSTEM)
    api.fleet.store("cpu", SYSTEM, tier=Tier.CPU)
    api.fleet.store("both", SYSTEM, tier=Tier.CPU)
    api.fleet.store("both", SYSTEM)  # a block on GPU and CPU counts as GPU
    answer = api.score(token_ids=SYSTEM)
    assert answer.best in {"gpu", "both"}
    assert answer.scores[-1].replica == "cpu"
    assert entry(answer, "both").tiers == {"gpu": 4, "cpu": 0, "other": 0}
    ratio = entry(answer, "cpu").score / entry(answer, "gpu").score
    assert ratio == pytest.approx(W.cpu / W.gpu)


def test_block_keys_give_the_same_answer_as_token_ids(api: Api) -> None:
    api.fleet.add("r1", "r2")
    api.fleet.store("r1", SYSTEM, lora_name="sql-lora", extra_keys=[("sql-lora",)] * 4)
    api.fleet.store("r2", SYSTEM[: 2 * BLOCK], lora_name="sql-lora", extra_keys=[("sql-lora",)] * 2)
    request = SYSTEM + USER
    by_tokens = api.score(token_ids=request, lora_name="sql-lora")
    keys = block_keys(MODEL, request, BLOCK, lora_name="sql-lora")
    by_keys = api.score(block_keys=keys)
    assert by_keys.best == by_tokens.best == "r1"
    assert by_keys.num_blocks == by_tokens.num_blocks == 6
    assert [(e.replica, e.matched_blocks, e.score) for e in by_keys.scores] == [
        (e.replica, e.matched_blocks, e.score) for e in by_tokens.scores
    ]


def test_answer_names_the_data_parallel_rank_holding_the_match(api: Api) -> None:
    api.fleet.add("r1", "r2", dp_size=2)
    api.fleet.store("r1", SYSTEM[:BLOCK], rank=0)
    api.fleet.store("r1", SYSTEM, rank=1)
    api.fleet.store("r2", SYSTEM[: 2 * BLOCK], rank=0)
    answer = api.score(token_ids=SYSTEM)
    assert answer.best == "r1"
    assert (entry(answer, "r1").rank, entry(answer, "r1").matched_blocks) == (1, 4)
    assert (entry(answer, "r2").rank, entry(answer, "r2").matched_blocks) == (0, 2)


# --- 2. load --------------------------------------------------------------------------------

REQUEST_BLOCKS = 10
THRESHOLD_BLOCKS = LOADED_PENALTY / W.cache * REQUEST_BLOCKS
"""kv_aware: a replica with fresh load LOADED must hold more than this many of the
request's blocks (8 of 10 with the defaults) to beat an idle replica holding none:
``w.cache · cached / num_blocks > w.waiting·waiting + w.running·running + w.kv_usage·usage``."""


@pytest.mark.parametrize(("cached_blocks", "best"), [(7, "idle"), (9, "loaded")])
def test_loaded_replica_wins_only_when_its_cache_gain_outweighs_its_load(
    api: Api, cached_blocks: int, best: str
) -> None:
    assert (cached_blocks > THRESHOLD_BLOCKS) == (best == "loaded")
    conversation = tokens(1_000, REQUEST_BLOCKS)
    api.fleet.add("loaded", "idle")
    api.fleet.store("loaded", conversation[: cached_blocks * BLOCK])
    api.push_load("loaded", **LOADED)
    api.push_load("idle", **IDLE)
    answer = api.score(token_ids=conversation)
    assert answer.best == best
    loaded = entry(answer, "loaded")
    recency = loaded.terms["load_recency"]
    assert 0.9 < recency <= 1.0  # measured just now
    assert loaded.terms["load"] == pytest.approx(-LOADED_PENALTY * recency)
    assert loaded.score == pytest.approx(cached_blocks / REQUEST_BLOCKS - LOADED_PENALTY * recency)
    assert entry(answer, "idle").score == 0.0


def test_old_load_weighs_less(api: Api) -> None:
    hour = 3600.0
    api.fleet.add("old", "fresh")
    api.fleet.store("old", SYSTEM)
    api.fleet.store("fresh", SYSTEM)
    api.push_load("old", **LOADED, ts=time.time() - hour)
    api.push_load("fresh", **LOADED)
    answer = api.score(token_ids=SYSTEM)
    assert answer.best == "old"
    old, fresh = entry(answer, "old"), entry(answer, "fresh")
    assert old.load is not None and fresh.load is not None
    assert hour <= old.load.age_s < hour + 30
    assert fresh.load.age_s < 30
    assert old.terms["load_recency"] < 1e-100  # 0.5 ** (3600 / 10)
    assert fresh.terms["load"] == pytest.approx(-LOADED_PENALTY * fresh.terms["load_recency"])


def test_unknown_load_costs_nothing(api: Api) -> None:
    api.fleet.add("r1")
    r1 = entry(api.score(token_ids=SYSTEM), "r1")
    assert r1.load is None
    assert (r1.terms["load"], r1.terms["load_recency"]) == (0.0, 0.0)


# --- 3. freshness ---------------------------------------------------------------------------


def test_stale_replica_loses_a_tie_to_a_live_one(api: Api) -> None:
    api.fleet.add("live", "stale")
    api.fleet.store("live", SYSTEM)
    api.fleet.store("stale", SYSTEM)
    api.fleet.stale("stale")
    answer = api.score(token_ids=SYSTEM)
    assert answer.best == "live"
    stale = entry(answer, "stale")
    assert stale.freshness.state == "stale"
    assert stale.terms["freshness_factor"] == W.stale_factor
    assert stale.score == pytest.approx(W.stale_factor * entry(answer, "live").score)


def test_replaying_replica_gets_the_replaying_factor(api: Api) -> None:
    api.fleet.add("live", "replaying")
    api.fleet.store("live", SYSTEM)
    api.fleet.store("replaying", SYSTEM)
    api.fleet.replaying("replaying")
    answer = api.score(token_ids=SYSTEM)
    assert answer.best == "live"
    replaying = entry(answer, "replaying")
    assert replaying.freshness.state == "replaying"
    assert replaying.terms["freshness_factor"] == W.replaying_factor


def test_replica_never_heard_from_counts_as_stale(api: Api) -> None:
    api.fleet.registry.add(ReplicaSpec(id="silent", model=MODEL))
    silent = entry(api.score(token_ids=SYSTEM), "silent")
    assert silent.freshness.state == "stale"
    assert silent.terms["freshness_factor"] == W.stale_factor


# --- 4. candidates, models, bodies, weights -------------------------------------------------


def test_candidates_limit_the_choice(api: Api) -> None:
    api.fleet.add("r1", "r2", "r3")
    api.fleet.store("r1", SYSTEM)
    api.fleet.store("r3", SYSTEM[:BLOCK])
    answer = api.score(token_ids=SYSTEM, candidates=["r3", "r2", "r3"])
    assert answer.best == "r3"
    assert sorted(e.replica for e in answer.scores) == ["r2", "r3"]


def test_top_k_explains_the_best_and_counts_the_rest(make_api: ApiFactory) -> None:
    """Over HTTP on each store: the answer's entries are the best ``top_k`` (the setting's
    default, more when asked, every one with 0), the rest only counted; ``best`` the same."""
    api = make_api(dataclasses.replace(SETTINGS, default_top_k=2))
    api.fleet.add("r1", "r2", "r3", "r4", "r5")
    for replica, num_blocks in (("r2", 4), ("r4", 2), ("r5", 1)):
        api.fleet.store(replica, SYSTEM[: num_blocks * BLOCK])
    answers = {k: api.score(token_ids=SYSTEM, top_k=k, dry_run=True) for k in (None, 3, 0)}
    assert [e.replica for e in answers[None].scores] == ["r2", "r4"]
    assert [e.replica for e in answers[3].scores] == ["r2", "r4", "r5"]
    assert sorted(e.replica for e in answers[0].scores) == ["r1", "r2", "r3", "r4", "r5"]
    assert {(a.best, a.num_candidates, a.num_matched) for a in answers.values()} == {("r2", 5, 3)}
    body = api.post("/score", {"model": MODEL, "token_ids": SYSTEM, "top_k": 1}).json()
    assert (len(body["scores"]), body["num_candidates"], body["num_matched"]) == (1, 5, 3)


def test_unknown_candidate_is_422_naming_it(api: Api) -> None:
    api.fleet.add("r1")
    api.fleet.add("elsewhere", model="other-model")
    body = {"model": MODEL, "token_ids": SYSTEM, "candidates": ["r1", "nope", "elsewhere"]}
    detail = error_of(api.post("/score", body), 422)
    assert "candidates" in detail
    assert "'nope'" in detail and "'elsewhere'" in detail


def test_unknown_model_is_404_naming_the_known_models(api: Api) -> None:
    api.fleet.add("r1")
    api.fleet.add("r2", model="other-model")
    response = api.post("/score", {"model": "no-such-model", "token_ids": SYSTEM})
    detail = error_of(response, 404)
    assert response.json()["error"] == "unknown_model"
    assert "'no-such-model'" in detail
    assert f"known models: {sorted([MODEL, 'other-model'])}" in detail


BAD_BODIES = [
    pytest.param({"token_ids": "1 2 3"}, "`$.token_ids`", id="wrong-type"),
    pytest.param({"token_ids": [1, 2.5]}, "`$.token_ids[1]`", id="float-token"),
    pytest.param({"token_ids": [1, -5]}, "`$.token_ids[1]`", id="negative-token"),
    pytest.param({"token_ids": [2**32]}, "`$.token_ids[0]`", id="token-over-u32"),
    pytest.param({"token_ids": [1], "tokens": [1]}, "unknown field `tokens`", id="unknown-field"),
    pytest.param(
        {"token_ids": [1], "block_keys": [1]}, "got ['token_ids', 'block_keys']", id="two-inputs"
    ),
    pytest.param({}, "give exactly one of token_ids, prompt, messages", id="no-input"),
    pytest.param({"block_keys": [-1]}, "`$.block_keys[0]`", id="negative-key"),
    pytest.param({"block_keys": [2**64]}, "block_keys:", id="key-over-u64"),
    pytest.param({"token_ids": [1], "policy": "fastest"}, "policy: 'fastest'", id="bad-policy"),
    pytest.param({"token_ids": [1], "weights": {"speed": 1.0}}, "['speed']", id="unknown-weight"),
    pytest.param({"token_ids": [1], "weights": {"cpu": -1.0}}, "weight cpu", id="negative-weight"),
    pytest.param(
        {"token_ids": [1], "weights": {"prefix_blocks": 2.5}}, "prefix_blocks", id="half-block"
    ),
    pytest.param({"token_ids": [1], "weights": {"cpu": "high"}}, "`$.weights", id="weight-type"),
    pytest.param({"prompt": "hello"}, "prompt: no tokenizer", id="prompt-without-tokenizer"),
    pytest.param({"token_ids": [1], "policy": "session_affinity"}, "session:", id="no-session"),
    pytest.param({"token_ids": [1], "top_k": -1}, "`$.top_k`", id="negative-top-k"),
    pytest.param({"token_ids": [1], "top_k": 1.5}, "`$.top_k`", id="fractional-top-k"),
]


@MEMORY_ONLY
@pytest.mark.parametrize(("body", "named"), BAD_BODIES)
def test_bad_score_body_is_422_naming_the_field(api: Api, body: dict[str, Any], named: str) -> None:
    api.fleet.add("r1")
    response = api.post("/score", {"model": MODEL} | body)
    assert named in error_of(response, 422)
    assert response.json()["error"] == "invalid_request"


@MEMORY_ONLY
def test_score_body_without_model_or_not_json_is_422(api: Api) -> None:
    assert "`model`" in error_of(api.post("/score", {"token_ids": [1]}), 422)
    assert "JSON" in error_of(api.request("POST", "/score", content=b"{oops"), 422)


def test_weights_override_applies_to_that_request_only(api: Api) -> None:
    api.fleet.add("r1")
    api.fleet.store("r1", SYSTEM, tier=Tier.CPU)
    custom = api.score(token_ids=SYSTEM, weights={"cpu": 0.25, "prefix_blocks": 2})
    assert entry(custom, "r1").terms["cache"] == pytest.approx(0.25)
    assert (custom.weights["cpu"], custom.weights["prefix_blocks"]) == (0.25, 2.0)
    default = api.score(token_ids=SYSTEM)
    assert entry(default, "r1").terms["cache"] == pytest.approx(W.cpu)
    assert default.weights == W.as_dict()


# --- 5. policies ----------------------------------------------------------------------------


def bests(api: Api, num: int, **body: Any) -> list[str | None]:
    return [api.score(**body).best for _ in range(num)]


def test_round_robin_cycles_through_the_candidates(api: Api) -> None:
    api.fleet.add("r1", "r2", "r3")
    api.fleet.store("r3", SYSTEM)  # the cache plays no part
    picks = bests(api, 6, token_ids=SYSTEM, policy="round_robin")
    assert picks == ["r1", "r2", "r3", "r1", "r2", "r3"]
    subset = bests(api, 4, token_ids=SYSTEM, policy="round_robin", candidates=["r3", "r1"])
    assert set(subset[:2]) == {"r1", "r3"} and subset[2:] == subset[:2]


def test_random_picks_among_candidates_reproducibly_with_a_seed(make_api: ApiFactory) -> None:
    def picks(settings: ApiSettings) -> list[str | None]:
        api = make_api(settings)
        api.fleet.add("r1", "r2", "r3", "r4")
        body = {"token_ids": SYSTEM, "policy": "random", "candidates": ["r2", "r3", "r4"]}
        return bests(api, 30, **body)

    first = picks(SETTINGS)
    assert set(first) == {"r2", "r3", "r4"}
    assert picks(SETTINGS) == first
    assert picks(dataclasses.replace(SETTINGS, seed=8)) != first


def test_least_load_picks_the_idle_replica_regardless_of_cache(api: Api) -> None:
    api.fleet.add("busy", "idle")
    api.fleet.store("busy", SYSTEM)
    api.push_load("busy", running=1.0, waiting=0.0, kv_usage=0.1)
    api.push_load("idle", **IDLE)
    answer = api.score(token_ids=SYSTEM, policy="least_load")
    assert (answer.best, answer.policy) == ("idle", "least_load")
    assert "cache" not in entry(answer, "busy").terms


def test_session_affinity_is_stable_per_session_and_spreads_sessions(api: Api) -> None:
    api.fleet.add("r1", "r2", "r3", "r4")

    def owners() -> dict[str, str | None]:
        body: dict[str, Any] = {"token_ids": SYSTEM, "policy": "session_affinity"}
        return {s: api.score(**body, session=s).best for s in (f"user-{i}" for i in range(40))}

    first = owners()
    api.fleet.store("r1", SYSTEM)  # the cache plays no part
    assert owners() == first
    assert len(set(first.values())) >= 3


def test_prefix_hash_is_stable_for_the_same_leading_blocks(api: Api) -> None:
    api.fleet.add("r1", "r2", "r3", "r4")
    head = tokens(1_000, W.prefix_blocks)
    tails = [tokens(100_000 + 1_000 * i, 3) for i in range(10)]
    same_head = {api.score(token_ids=head + t, policy="prefix_hash").best for t in tails}
    assert len(same_head) == 1  # blocks after the first prefix_blocks are ignored
    heads = [tokens(200_000 + 1_000 * i, W.prefix_blocks) for i in range(40)]
    spread = {api.score(token_ids=h, policy="prefix_hash").best for h in heads}
    assert len(spread) >= 3


def test_prefix_hash_block_count_is_a_weight(api: Api) -> None:
    api.fleet.add("r1", "r2", "r3", "r4")
    body: dict[str, Any] = {"policy": "prefix_hash", "weights": {"prefix_blocks": 1}}
    firsts = [tokens(100_000 + 1_000 * i, 1) for i in range(10)]
    spread = {api.score(token_ids=f + SYSTEM, **body).best for f in firsts}
    same = {api.score(token_ids=SYSTEM[:BLOCK] + f, **body).best for f in firsts}
    assert len(spread) >= 2
    assert len(same) == 1


def test_model_policy_applies_when_the_request_names_none(make_api: ApiFactory) -> None:
    models = (ModelSpec(MODEL, policy="least_load"),)
    api = make_api(dataclasses.replace(SETTINGS, models=models))
    api.fleet.add("r1")
    api.fleet.add("r2", model="other-model")
    assert api.score(token_ids=SYSTEM).policy == "least_load"
    assert api.score(token_ids=SYSTEM, policy="round_robin").policy == "round_robin"
    assert api.score(model="other-model", token_ids=SYSTEM).policy == SETTINGS.default_policy


@MEMORY_ONLY
def test_a_routing_rule_chooses_the_policy_and_the_answer_names_it(
    make_api: ApiFactory,
) -> None:
    rules = (
        RoutingRule(
            "acme-batch",
            headers=(("x-tenant", ("acme",)),),
            workload=("batch",),
            policy="least_load",
        ),
        RoutingRule("long", min_prompt_tokens=len(SYSTEM + USER), policy="prefix_hash"),
    )
    api = make_api(dataclasses.replace(SETTINGS, rules=rules))
    api.fleet.add("r1", "r2")
    body = {"model": MODEL, "token_ids": SYSTEM, "workload": "batch"}
    tenant = api.request("POST", "/score", body, headers={"X-Tenant": "acme"})
    assert tenant.status_code == 200, tenant.text
    assert (tenant.json()["rule"], tenant.json()["policy"]) == ("acme-batch", "least_load")
    by_header = {"X-Tenant": "acme", "X-Kvindex-Workload": "batch"}
    del body["workload"]
    assert api.request("POST", "/score", body, headers=by_header).json()["rule"] == "acme-batch"
    other = api.request("POST", "/score", body, headers={"X-Tenant": "globex"}).json()
    assert (other["rule"], other["policy"]) == (None, SETTINGS.default_policy)
    long = api.score(token_ids=SYSTEM + USER)
    assert (long.rule, long.policy) == ("long", "prefix_hash")


def test_concurrent_requests_share_one_app(stores: Stores) -> None:
    fleet = Fleet.over(stores.index)
    fleet.add("r1", "r2")
    fleet.store("r2", SYSTEM)
    app = create_app(ApiDeps(SETTINGS, stores.index, fleet.registry, stores.loads, stores.blocking))
    body = {"model": MODEL, "token_ids": SYSTEM + USER}

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client,
        ):
            return await asyncio.gather(*(client.post("/score", json=body) for _ in range(32)))

    responses = asyncio.run(main())
    assert {(r.status_code, r.json()["best"]) for r in responses} == {(200, "r2")}


# --- 6. the store goes away -----------------------------------------------------------------


@pytest.fixture
def fragile_api(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[Api]:
    """An app on a Redis client that gives up quickly; the server is running again after."""
    client = connect(redis_server.url, socket_timeout_s=0.5)
    schema = Schema("outage")
    api = open_api(
        SETTINGS, RedisIndex(client, schema), RedisLoadStore(client, schema), blocking_store=True
    )
    try:
        yield api
    finally:
        api.close()
        client.close()
        if redis_server.process.poll() is not None:
            redis_server.restart()


def test_redis_outage_answers_from_load_alone_and_recovers(
    fragile_api: Api, redis_server: RedisServer
) -> None:
    api = fragile_api
    api.fleet.add("cached", "idle")
    api.fleet.store("cached", SYSTEM)
    api.push_load("cached", running=2.0, waiting=3.0, kv_usage=0.5)
    api.push_load("idle", **IDLE)
    redis_server.stop()  # the scorer has seen those loads only as they were pushed
    answer = api.score(token_ids=SYSTEM)
    assert answer.degraded is not None and "redis" in answer.degraded
    assert answer.best == "idle"
    assert matched(answer) == {"cached": 0, "idle": 0}
    cached_load = entry(answer, "cached").load
    assert cached_load is not None and cached_load.waiting == 3.0
    assert api.get("/readyz").status_code == 503
    assert api.get("/healthz").status_code == 200
    assert api.get("/metrics").status_code == 200
    assert api.get("/stats").json()["error"] == "store_unavailable"
    redis_server.restart()
    wait_until(lambda: api.get("/readyz").status_code == 200, what="ready again")
    assert api.score(token_ids=SYSTEM).degraded is None


# --- 7. replicas, stats, metrics, OpenAPI, auth ---------------------------------------------


def test_replicas_register_list_and_delete(api: Api) -> None:
    body = {"id": "r7", "model": MODEL, "dp_size": 2}
    created = api.post("/replicas", body)
    assert (created.status_code, created.json()) == (201, {"status": "created", "id": "r7"})
    assert [(r["id"], r["state"]) for r in api.get("/replicas").json()] == [("r7", "stale")]
    again = api.post("/replicas", body)
    assert (again.status_code, again.json()) == (200, {"status": "unchanged", "id": "r7"})
    api.fleet.store("r7", SYSTEM, rank=1)
    (view,) = api.get("/replicas").json()
    assert (view["id"], view["model"], view["dp_size"], view["state"]) == ("r7", MODEL, 2, "live")
    assert [(s["rank"], s["blocks"]["gpu"]) for s in view["streams"]] == [(1, 4)]
    assert api.request("DELETE", "/replicas/r7").status_code == 200
    assert api.get("/replicas").json() == []
    assert api.fleet.index.streams() == []
    assert api.fleet.index.stats(StreamId("r7", 1)).num_blocks == 0
    assert api.request("DELETE", "/replicas/r7").status_code == 404


@MEMORY_ONLY
@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"id": "bad id", "model": MODEL}, "replica id"),
        ({"id": "r1", "model": MODEL, "dp_size": 0}, "dp_size"),
        ({"id": "r1", "model": MODEL, "dp_size": 2**40}, "dp_size must be in [1, 1024]"),
        ({"id": "r1"}, "`model`"),
        ({"id": "r1", "model": MODEL, "events": "http://x"}, "events"),
        ({"id": "r1", "model": MODEL, "url": "file:///etc/passwd"}, "url must be an http://"),
        ({"id": "r1", "model": MODEL, "url": "http://169.254.169.254"}, "link-local"),
    ],
)
def test_bad_replica_body_is_422_naming_the_field(
    api: Api, body: dict[str, Any], named: str
) -> None:
    assert named in error_of(api.post("/replicas", body), 422)


@MEMORY_ONLY
def test_replica_networks_limit_where_urls_may_point(make_api: ApiFactory) -> None:
    api = make_api(dataclasses.replace(SETTINGS, replica_networks=("10.0.0.0/8",)))
    inside = {"id": "r1", "model": MODEL, "url": "http://10.0.0.5:8000"}
    assert api.post("/replicas", inside).status_code == 201
    outside = {"id": "r2", "model": MODEL, "url": "http://127.0.0.1:8000"}
    assert "outside api.replica_networks" in error_of(api.post("/replicas", outside), 422)
    assert [r["id"] for r in api.get("/replicas").json()] == ["r1"]


@MEMORY_ONLY
@pytest.mark.parametrize(
    ("report", "named"),
    [
        ({"replica": "nope", "running": 1, "waiting": 1}, "replica: 'nope'"),
        ({"replica": "r1", "running": 1, "waiting": 1, "kv_usage": 1.5}, "kv_usage"),
        ({"replica": "r1", "running": 1, "waiting": -1}, "waiting"),
        ({"replica": "r1", "running": 1}, "`waiting`"),
        ({"replica": "r1", "running": 1, "waiting": 1, "ts": 10**12}, "ts must be at most 60 s"),
        ({"replica": "r1", "running": 1, "waiting": 1, "ts": -1}, "ts must be a finite number"),
    ],
)
def test_bad_load_report_is_422_naming_the_field(
    api: Api, report: dict[str, Any], named: str
) -> None:
    api.fleet.add("r1")
    assert named in error_of(api.post("/load", report), 422)


def test_stats_count_replicas_streams_and_blocks(api: Api) -> None:
    api.fleet.add("r1", "r2")
    api.fleet.store("r1", SYSTEM)
    api.fleet.store("r2", SYSTEM[: 2 * BLOCK], tier=Tier.CPU)
    stats = api.get("/stats").json()
    assert (stats["replicas"], stats["streams"]) == (2, 2)
    assert stats["blocks"] == {"gpu": 4, "cpu": 2, "other": 0}


def test_metrics_expose_score_latency_and_blocks(api: Api) -> None:
    api.fleet.add("r1")
    api.fleet.store("r1", SYSTEM)
    api.score(token_ids=SYSTEM)
    response = api.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }
    assert samples[("kvindex_score_seconds_count", (("policy", "kv_aware"),))] == 1.0
    blocks = (("model", MODEL), ("rank", "0"), ("replica", "r1"), ("tier", "gpu"))
    assert samples[("kvindex_blocks", blocks)] == 4.0


def test_config_shows_policy_weights_and_block_sizes(api: Api) -> None:
    api.fleet.add("r1")
    api.fleet.store("r1", SYSTEM)
    config = api.get("/config").json()
    assert config == {
        "default_policy": "kv_aware",
        "weights": W.as_dict(),
        "models": {MODEL: {"block_size": BLOCK}},
        "rules": [],
    }


@MEMORY_ONLY
def test_config_lists_the_rules_and_metrics_count_the_answers_each_matched(
    make_api: ApiFactory,
) -> None:
    tables: list[dict[str, Any]] = [
        {"name": "batch", "workload": ["batch"], "policy": "least_load"},
        {"name": "long", "min_prompt_tokens": 4 * BLOCK, "weights": {"waiting": 0.3}},
    ]
    rules = tuple(rule_from_table(table, i) for i, table in enumerate(tables, 1))
    api = make_api(dataclasses.replace(SETTINGS, rules=rules))
    api.fleet.add("r1")
    assert api.get("/config").json()["rules"] == tables
    assert api.score(token_ids=SYSTEM, workload="batch").rule == "batch"
    assert api.score(token_ids=SYSTEM).rule == "long"
    assert api.score(token_ids=SYSTEM, workload="batch").rule == "batch"
    assert api.score(token_ids=SYSTEM[:BLOCK]).rule is None
    samples = {
        s.labels["rule"]: s.value
        for family in text_string_to_metric_families(api.get("/metrics").text)
        for s in family.samples
        if s.name == "kvindex_score_rule_matches_total"
    }
    assert samples == {"batch": 2, "long": 1}


def refs(node: object) -> Iterator[str]:
    """Every ``$ref`` in an OpenAPI document."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from refs(item)


@MEMORY_ONLY
def test_openapi_documents_score_with_its_schemas(api: Api) -> None:
    doc = api.get("/openapi.json").json()
    score = doc["paths"]["/score"]["post"]
    body = score["requestBody"]["content"]["application/json"]["schema"]
    answer = score["responses"]["200"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ScoreRequest"}
    assert answer == {"$ref": "#/components/schemas/ScoreResponse"}
    schemas = doc["components"]["schemas"]
    assert {"model", "token_ids", "block_keys", "weights"} <= set(
        schemas["ScoreRequest"]["properties"]
    )
    assert {"best", "scores", "degraded"} <= set(schemas["ScoreResponse"]["properties"])
    prefix = "#/components/schemas/"
    assert all(r.startswith(prefix) and r[len(prefix) :] in schemas for r in refs(doc))


@MEMORY_ONLY
def test_openapi_documents_every_answer_and_error(api: Api) -> None:
    doc = api.get("/openapi.json").json()
    prefix = "#/components/schemas/"
    answers = {
        ("get", "/replicas"): {"type": "array", "items": {"$ref": prefix + "ReplicaView"}},
        ("post", "/replicas"): {"$ref": prefix + "StatusBody"},
        ("delete", "/replicas/{replica_id}"): {"$ref": prefix + "StatusBody"},
        ("post", "/load"): {"$ref": prefix + "StatusBody"},
        ("get", "/stats"): {"$ref": prefix + "StatsView"},
        ("get", "/config"): {"$ref": prefix + "ConfigView"},
        ("post", "/score"): {"$ref": prefix + "ScoreResponse"},
    }
    for (method, path), schema in answers.items():
        responses = doc["paths"][path][method]["responses"]
        assert responses["200"]["content"]["application/json"]["schema"] == schema, path
        error = responses["default"]["content"]["application/json"]["schema"]
        assert error == {"$ref": prefix + "ErrorBody"}, path
    created = doc["paths"]["/replicas"]["post"]["responses"]["201"]
    assert created["content"]["application/json"]["schema"] == {"$ref": prefix + "StatusBody"}
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == [api.get("/metrics").headers["content-type"]]
    # the documented bodies are the ones served
    stats = api.get("/stats").json()
    assert set(stats) == set(doc["components"]["schemas"]["StatsView"]["properties"])
    config = api.get("/config").json()
    assert set(config) == set(doc["components"]["schemas"]["ConfigView"]["properties"])


TOKEN = "s3cret-token"
HEALTH = {"/healthz", "/readyz"}


@MEMORY_ONLY
def test_every_route_but_health_needs_the_bearer_token(make_api: ApiFactory) -> None:
    api = make_api(dataclasses.replace(SETTINGS, auth_token=TOKEN))
    api.fleet.add("r1")
    routes = [  # every documented route: a route added later is covered too
        (method.upper(), path.replace("{replica_id}", "r1"))
        for path, operations in api.app.openapi()["paths"].items()
        for method in operations
    ]
    guarded = [(m, p) for m, p in routes if p not in HEALTH]
    assert {p for _, p in guarded} >= {"/score", "/load", "/replicas", "/stats", "/metrics"}
    for method, path in guarded:
        refused = api.request(method, path)
        assert refused.status_code == 401, (method, path)
        assert refused.headers["www-authenticate"] == 'Bearer realm="kvindex"'
        wrong = {"Authorization": "Bearer not-it"}
        assert api.request(method, path, headers=wrong).status_code == 401, (method, path)
    for path in HEALTH:
        assert api.get(path).status_code == 200
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert api.request("GET", "/stats", headers=bearer).status_code == 200
    # The schema is behind the token too; the browsable docs (which cannot send it) are off.
    assert api.get("/openapi.json").status_code == 401
    served = api.request("GET", "/openapi.json", headers=bearer)
    assert served.status_code == 200
    assert served.json()["paths"].keys() == api.app.openapi()["paths"].keys()
    for page in ("/docs", "/redoc"):
        assert api.request("GET", page, headers=bearer).status_code == 404
    body = {"model": MODEL, "token_ids": SYSTEM}
    assert api.request("POST", "/score", body, headers=bearer).status_code == 200
