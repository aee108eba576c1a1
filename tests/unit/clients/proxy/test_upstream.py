"""The upstream choice on the real scorer, memory index and registry (no services)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest

from kvindex.api.config.settings import ApiSettings
from kvindex.api.decision.routing_rules import RoutingRule
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.schemas import ScoreRequest
from kvindex.api.score import RequestError, Scorer, UnknownModelError
from kvindex.api.tokenize.protocol import NO_OPTIONS, ChatOptions, Tokenizer, TokenizerError
from kvindex.clients.proxy.upstream import (
    MAX_DEPTH,
    BadRequestBodyError,
    Choice,
    NoUpstreamError,
    UpstreamPicker,
    _deeper_than,
    decoded_body,
)
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.domain.keys import block_keys
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.fleet.replica_health import HealthPolicy
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import Op, OpKind

MODEL = "m"
NOW = 1_000.0


class WordTokenizer:
    """One token per word; the whole conversation, every message's content in turn."""

    def __init__(self) -> None:
        self.fail = False
        self.seen: list[object] = []

    async def encode_prompt(self, prompt: str) -> list[int]:
        self.seen.append(prompt)
        return self._tokens(prompt)

    async def encode_messages(
        self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS
    ) -> list[int]:
        self.seen.append((messages, options) if options.fields() else messages)
        return self._tokens(" ".join(str(m["content"]) for m in messages))

    def _tokens(self, text: str) -> list[int]:
        if self.fail:
            raise TokenizerError("the replica's /tokenize is down")
        return [len(word) * 100 + ord(word[0]) for word in text.split()]


class Fleet:
    """Replicas a, b, c of one model with URLs, and d with none."""

    def __init__(self, policy: str = "kv_aware", rules: tuple[RoutingRule, ...] = ()) -> None:
        with_url = [ReplicaSpec(r, MODEL, url=f"http://{r}:8000") for r in ("a", "b", "c")]
        specs = (*with_url, ReplicaSpec("d", MODEL))
        self.registry = Registry(specs, clock=lambda: NOW)
        self.index = MemoryIndex()
        self.tokenizer = WordTokenizer()
        tokenizer: Tokenizer = self.tokenizer
        self.scorer = scorer = Scorer(
            ApiSettings(seed=1, default_policy=policy, rules=rules),
            self.index,
            self.registry,
            MemoryLoadStore(),
            tokenizers=lambda model: tokenizer if model == MODEL else None,
            blocking_store=False,
            clock=lambda: NOW,
        )
        self.failures: list[str] = []
        self.picker = UpstreamPicker(
            scorer,
            self.registry,
            on_tokenize_failure=self.failures.append,
            lora_base=lambda name: MODEL if name == "sql-lora" else None,
        )

    def hold(
        self,
        replica: str,
        tokens: list[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        keys = block_keys(MODEL, tokens, 16, lora_name=lora_name, cache_salt=cache_salt)
        ops: list[Op] = [(OpKind.STORE, Tier.GPU, i, k) for i, k in enumerate(keys)]
        self.index.apply(StreamId(replica), 0, NOW, ops)
        self.registry.record(StreamId(replica), StreamReport(last_seq=0, last_event_ts=NOW))

    def choose(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> Choice:
        return asyncio.run(self.picker.choose(body, headers or {}))


def _words(n: int, prefix: str) -> str:
    return " ".join(f"{prefix}{i:03d}" for i in range(n))


def test_the_whole_conversation_decides_and_only_replicas_with_a_url_are_tried() -> None:
    fleet = Fleet()
    system = {"role": "system", "content": _words(32, "s")}
    user = {"role": "user", "content": _words(32, "u")}
    whole = asyncio.run(fleet.tokenizer.encode_messages([system, user]))
    first_only = asyncio.run(fleet.tokenizer.encode_messages([system]))
    fleet.hold("b", first_only)  # the system prompt alone: 2 blocks of 4
    fleet.hold("c", whole)  # the whole conversation: 4 blocks
    choice = fleet.choose({"model": MODEL, "messages": [system, user]})
    assert [u.replica for u in choice.upstreams][:2] == ["c", "b"]
    assert {u.replica for u in choice.upstreams} == {"a", "b", "c"}  # d has no url
    assert choice.upstreams[0].url == "http://c:8000"
    assert choice.matched_fraction == 1.0


def test_a_model_whose_replicas_all_have_urls_is_ranked_as_its_candidates_listed() -> None:
    """The picker then leaves ``candidates`` out (the scorer's own list): the same rankings,
    request after request, as a twin fleet's scorer asked with every replica listed."""
    picked, listed = Fleet(), Fleet()
    system = {"role": "system", "content": _words(32, "s")}
    whole = asyncio.run(picked.tokenizer.encode_messages([system]))
    for fleet in (picked, listed):
        fleet.registry.remove("d")
        fleet.hold("b", whole)
        fleet.hold("c", whole[:16])
    request = ScoreRequest(model=MODEL, candidates=["a", "b", "c"], messages=[system])
    for _ in range(4):  # each answer counts as load: the rankings change
        choice = picked.choose({"model": MODEL, "messages": [system]})
        ranking = asyncio.run(listed.scorer.ranking(request))
        ranked = tuple((u.replica, u.num_matched_tokens) for u in choice.upstreams)
        assert ranked == ranking.ranked


def test_what_else_a_chat_body_renders_reaches_the_tokenizer() -> None:
    """Tools, documents, template variables and the generation flags go with the messages;
    a member of the wrong type is left out (the engine will refuse that body itself)."""
    fleet = Fleet()
    user = {"role": "user", "content": _words(8, "u")}
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = {
        "model": MODEL,
        "messages": [user],
        "tools": tools,
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": False,
        "continue_final_message": True,
        "documents": "not a list",
    }
    fleet.choose(body)
    wanted = ChatOptions(
        tools=tools,
        chat_template_kwargs={"enable_thinking": False},
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert fleet.tokenizer.seen[-1] == ([user], wanted)
    fleet.choose({"model": MODEL, "messages": [user], "tools": [1, 2]})
    assert fleet.tokenizer.seen[-1:] == [[user]]
    with pytest.raises(RequestError, match="only with messages"):  # /score's own check
        asyncio.run(fleet.scorer.score(ScoreRequest(model=MODEL, prompt="a b", tools=tools), {}))


def test_a_completion_prompt_string_or_token_ids_is_scored() -> None:
    fleet = Fleet()
    prompt = _words(48, "p")
    tokens = asyncio.run(fleet.tokenizer.encode_prompt(prompt))
    fleet.hold("a", tokens[:32])
    by_text = fleet.choose({"model": MODEL, "prompt": prompt})
    assert by_text.upstreams[0].replica == "a" and by_text.matched_fraction == 32 / 48
    by_ids = fleet.choose({"model": MODEL, "prompt": tokens})
    assert by_ids.upstreams[0].replica == "a" and by_ids.matched_fraction == 32 / 48


def test_a_prompt_that_cannot_be_tokenized_is_routed_on_load_alone() -> None:
    fleet = Fleet()
    fleet.tokenizer.fail = True
    choice = fleet.choose({"model": MODEL, "prompt": "a b c"})
    assert len(choice.upstreams) == 3 and choice.matched_fraction is None
    assert fleet.failures == [MODEL]


def test_the_session_header_or_user_field_feeds_session_affinity() -> None:
    fleet = Fleet("session_affinity")
    body = {"model": MODEL, "prompt": "x y", "cache_salt": None}
    chosen = set()
    for session in ("s1", "s2", "s3", "s4", "s5", "s6"):
        header = fleet.choose(body | {"user": "ignored"}, {"x-kvindex-session": session})
        field = fleet.choose(body | {"user": session})
        assert header.upstreams[0] == field.upstreams[0]
        chosen.add(header.upstreams[0].replica)
    assert len(chosen) > 1  # the session, not the prompt, decides


@pytest.mark.parametrize(
    ("rule", "body", "headers"),
    [
        (RoutingRule("agents", tools=True, policy="round_robin"), {"tools": [{}]}, {}),
        (RoutingRule("eval", user=("nightly",), policy="round_robin"), {"user": "nightly"}, {}),
        (
            RoutingRule("acme", headers=(("x-tenant", ("acme",)),), policy="round_robin"),
            {},
            {"x-tenant": "acme"},
        ),
        (
            RoutingRule("batch", workload=("batch",), policy="round_robin"),
            {},
            {"x-kvindex-workload": "batch"},
        ),
    ],
)
def test_rules_see_the_tools_the_user_and_the_headers_of_an_openai_body(
    rule: RoutingRule, body: dict[str, Any], headers: dict[str, str]
) -> None:
    fleet = Fleet(rules=(rule,))
    prompt = _words(32, "p")
    fleet.hold("c", asyncio.run(fleet.tokenizer.encode_prompt(prompt)))
    request = {"model": MODEL, "prompt": prompt}
    plain = {fleet.choose(request).upstreams[0].replica for _ in range(3)}
    assert plain == {"c"}  # kv_aware: where the prompt is cached
    matched = {fleet.choose(request | body, headers).upstreams[0].replica for _ in range(3)}
    assert matched == {"a", "b", "c"}  # the rule's round_robin


def test_bad_bodies_and_unknown_models_are_named() -> None:
    fleet = Fleet()
    with pytest.raises(BadRequestBodyError, match="model"):
        fleet.choose({"prompt": "a"})
    with pytest.raises(UnknownModelError, match="known models: \\['m'\\]"):
        fleet.choose({"model": "other", "prompt": "a"})
    no_url = Fleet()
    no_url.registry.remove("a")
    no_url.registry.remove("b")
    no_url.registry.remove("c")
    with pytest.raises(NoUpstreamError, match="no replica of 'm' has a url"):
        no_url.choose({"model": MODEL, "prompt": "a"})


def test_a_lora_name_in_model_goes_to_the_base_models_replicas_keyed_with_it() -> None:
    fleet = Fleet()
    prompt = _words(32, "q")
    tokens = asyncio.run(fleet.tokenizer.encode_prompt(prompt))
    fleet.hold("b", tokens)  # the base model's blocks of this prompt
    fleet.hold("c", tokens, lora_name="sql-lora")  # the LoRA's
    lora = fleet.choose({"model": "sql-lora", "prompt": prompt})
    assert lora.upstreams[0].replica == "c" and lora.matched_fraction == 1.0
    assert {u.replica for u in lora.upstreams} == {"a", "b", "c"}
    base = fleet.choose({"model": MODEL, "prompt": prompt})
    assert base.upstreams[0].replica == "b"
    with pytest.raises(UnknownModelError, match="other-lora"):
        fleet.choose({"model": "other-lora", "prompt": prompt})


def test_the_cache_salt_of_the_body_keys_the_blocks() -> None:
    fleet = Fleet()
    prompt = _words(32, "t")
    tokens = asyncio.run(fleet.tokenizer.encode_prompt(prompt))
    fleet.hold("a", tokens)
    fleet.hold("b", tokens, cache_salt="tenant-1")
    salted = fleet.choose({"model": MODEL, "prompt": prompt, "cache_salt": "tenant-1"})
    assert salted.upstreams[0].replica == "b" and salted.matched_fraction == 1.0
    assert fleet.choose({"model": MODEL, "prompt": prompt}).upstreams[0].replica == "a"


def test_a_request_without_a_model_goes_to_every_replica_with_a_url_in_turn() -> None:
    fleet = Fleet()
    firsts = [fleet.picker.choose_any().upstreams for _ in range(4)]
    assert [u[0].replica for u in firsts] == ["a", "b", "c", "a"]
    assert all({u.replica for u in ups} == {"a", "b", "c"} for ups in firsts)
    for replica in ("a", "b", "c"):
        fleet.registry.remove(replica)
    with pytest.raises(NoUpstreamError):
        fleet.picker.choose_any()


def _open_breaker(fleet: Fleet, replica: str) -> None:
    now = time.time()
    policy = HealthPolicy()
    fleet.registry.update_health({replica: lambda h: h.breaker_opened(now, policy, "status_502")})


def test_an_ejected_replica_is_neither_chosen_nor_a_retry() -> None:
    fleet = Fleet()
    prompt = " ".join(f"word{i}" for i in range(40))
    tokens = fleet.tokenizer._tokens(prompt)
    fleet.hold("b", tokens)
    assert fleet.choose({"model": MODEL, "prompt": prompt}).upstreams[0].replica == "b"
    _open_breaker(fleet, "b")
    choice = fleet.choose({"model": MODEL, "prompt": prompt})
    assert {u.replica for u in choice.upstreams} == {"a", "c"}


def test_a_request_without_a_model_skips_ejected_replicas_unless_all_are() -> None:
    fleet = Fleet()
    _open_breaker(fleet, "b")
    for _ in range(3):
        assert {u.replica for u in fleet.picker.choose_any().upstreams} == {"a", "c"}
    _open_breaker(fleet, "a")
    _open_breaker(fleet, "c")
    assert {u.replica for u in fleet.picker.choose_any().upstreams} == {"a", "b", "c"}


def _depth(value: Any) -> int:
    """The nesting of arrays and objects in ``value`` (the reference, recursive)."""
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def test_a_body_is_refused_exactly_when_it_nests_past_the_limit() -> None:
    deepest = {"model": "m", "messages": [{"content": [{"type": "text"}]}], "n": [[[[1]]], 2]}
    shapes: list[Any] = [1, "s", [], {}, [[]], deepest, [deepest, [deepest]], {"a": deepest}]
    for shape in shapes:
        for limit in range(7):
            assert _deeper_than(shape, limit) == (_depth(shape) > limit), (shape, limit)


def test_a_body_nested_too_deep_is_refused_before_anything_recurses() -> None:
    fits = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert decoded_body(fits) is not None
    for depth in (MAX_DEPTH + 1, 100_000):  # past msgspec's own guard too
        deep = b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"
        with pytest.raises(BadRequestBodyError, match="nests deeper"):
            decoded_body(deep)
    with pytest.raises(msgspec.DecodeError):
        decoded_body(b"{")


@pytest.mark.parametrize("explain", [1, 2, 8])
def test_an_explaining_picker_makes_the_same_choice_and_explains_at_most_its_bound(
    explain: int,
) -> None:
    plain, told = Fleet(), Fleet()
    told.picker = UpstreamPicker(told.picker._scorer, told.registry, explain=explain)
    prompt = _words(64, "e")
    tokens = asyncio.run(plain.tokenizer.encode_prompt(prompt))
    for fleet in (plain, told):
        fleet.hold("b", tokens[:48])
        fleet.hold("c", tokens[:16])
    body = {"model": MODEL, "prompt": prompt}
    chosen, explained = plain.choose(body), told.choose(body)
    assert plain.choose(body).reasons is None
    assert explained.reasons is not None
    answer = explained.reasons.answer()
    assert len(answer.scores) == min(explain, 3)
    assert explained.upstreams == chosen.upstreams[:explain]
    best = answer.scores[0]
    assert best.replica == "b" and best.matched_tokens == 48 and "cache" in best.terms
