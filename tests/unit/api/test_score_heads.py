"""kvindex.api.score: a ranking made on a prompt's head (``head_first``) is the ranking its
whole tokens make whenever a head is used: no replica holds the prompt's start; otherwise the
whole is tokenized and decides, as without heads."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from kvindex.api.config.settings import ApiSettings
from kvindex.api.decision.routing_rules import RoutingRule
from kvindex.api.load.model import Load
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.schemas import ScoreRequest
from kvindex.api.score import Ranking, Scorer
from kvindex.api.tokenize.cache import CachingTokenizer
from kvindex.api.tokenize.chat_template import ChatTemplate
from kvindex.api.tokenize.local import LocalTokenizer
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.domain.keys import chain_keys, model_root
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import OpKind
from tests.support.request_logs import text
from tests.support.tokenizer_kinds import KINDS

MODEL = "m"
NOW = 1_000.0


class Fleet:
    """Replicas a, b and c of one model, a local byte-level BPE with a ChatML template."""

    def __init__(self, settings: ApiSettings | None = None) -> None:
        self.registry = Registry(tuple(ReplicaSpec(r, MODEL) for r in "abc"), clock=lambda: NOW)
        self.index = MemoryIndex()
        self.loads = MemoryLoadStore()
        tok, template, specials = KINDS["byte_level_bpe"]()
        self.local = LocalTokenizer(tok, ChatTemplate(template, special_tokens=specials))
        tokenizer = CachingTokenizer(self.local)
        self.scorer = Scorer(
            settings or ApiSettings(seed=1),
            self.index,
            self.registry,
            self.loads,
            tokenizers=lambda _: tokenizer,
            blocking_store=False,
            clock=lambda: NOW,
        )

    def load(self, seed: int) -> None:
        rng = random.Random(seed)
        for replica in "abc":
            self.loads.put(replica, Load(rng.random() * 4, rng.random(), rng.random(), NOW, "push"))

    def hold(self, replica: str, messages: list[dict[str, Any]], num_blocks: int) -> None:
        """``replica`` holds the conversation's first blocks (tokenized apart, whole)."""
        tok, template, specials = KINDS["byte_level_bpe"]()
        whole = LocalTokenizer(tok, ChatTemplate(template, special_tokens=specials), fast=False)
        packed = asyncio.run(whole.packed_messages(messages))
        keys = chain_keys(model_root(MODEL), packed[: 64 * num_blocks], 16, None)
        ops = [(OpKind.STORE, Tier.GPU, k, k) for k in keys]
        self.index.apply(StreamId(replica), 0, NOW, ops)
        self.registry.record(StreamId(replica), StreamReport(last_seq=0, last_event_ts=NOW - 0.5))

    def ranking(self, messages: list[dict[str, Any]], head_first: bool, **fields: Any) -> Ranking:
        request = ScoreRequest(model=MODEL, messages=messages, **fields)
        return asyncio.run(self.scorer.ranking(request, head_first=head_first))


def _chat(seed: int, num_words: int = 600) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {"role": "system", "content": text(rng, num_words)},
        {"role": "user", "content": text(rng, 30)},
    ]


@pytest.mark.parametrize("seed", range(8))
def test_a_prompt_no_replica_holds_the_start_of_ranks_on_its_head_as_on_its_whole(
    seed: int,
) -> None:
    """Same loads, same seed: the head's ranking is the whole's, its tokens an estimate,
    its rest the whole ids (kept: the same prompt next is tokenized at once)."""
    on_head, on_whole = Fleet(), Fleet()
    for fleet in (on_head, on_whole):
        fleet.load(seed)
        fleet.hold("c", _chat(1_000 + seed), 8)  # another prompt's blocks: no match here
    chat = _chat(seed)
    head, whole = on_head.ranking(chat, True), on_whole.ranking(chat, False)
    assert head.ranked == whole.ranked
    assert head.rest is not None and whole.rest is None
    assert 0.7 < head.num_tokens / whole.num_tokens < 1.3
    assert len(asyncio.run(head.rest())) // 4 == whole.num_tokens
    again = on_head.ranking(chat, True)
    assert (again.rest, again.num_tokens) == (None, whole.num_tokens)  # routed: its own load


@pytest.mark.parametrize("num_blocks", [1, 3, 40])
def test_a_prompt_whose_start_is_held_ranks_on_its_whole(num_blocks: int) -> None:
    on_head, on_whole = Fleet(), Fleet()
    chat = _chat(7)
    for fleet in (on_head, on_whole):
        fleet.load(7)
        fleet.hold("b", chat, num_blocks)
    head, whole = on_head.ranking(chat, True), on_whole.ranking(chat, False)
    assert head.rest is None
    assert (head.num_tokens, head.ranked) == (whole.num_tokens, whole.ranked)
    assert dict(head.ranked)["b"] == 16 * num_blocks
    assert on_head.local.num_heads == 1  # tried, then the whole decided


def test_rules_on_prompt_tokens_other_policies_and_short_prompts_tokenize_whole() -> None:
    rule = RoutingRule(name="long", min_prompt_tokens=10, policy="kv_aware")
    by_rule = Fleet(ApiSettings(seed=1, rules=(rule,)))
    assert by_rule.ranking(_chat(1), True).rest is None
    fleet = Fleet()
    assert fleet.ranking(_chat(2), True, policy="least_load").rest is None
    assert fleet.ranking(_chat(3, 20), True).rest is None
    assert fleet.local.num_heads == 1  # least_load: known after the head, then made whole
    assert fleet.ranking(_chat(4), True).rest is not None
