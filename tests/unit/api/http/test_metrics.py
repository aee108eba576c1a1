"""kvindex.api.http.metrics: the API's own series, and the write path's only where it runs (the
write path's series themselves: tests/unit/indexer/test_metrics.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvindex
from kvindex.api.config.settings import ApiSettings
from kvindex.api.health.block_sizes import BlockSizeCheck
from kvindex.api.http.metrics import ApiMetrics, TimedIndex, TokenizerCollector
from kvindex.api.tokenize.cache import CachingTokenizer
from kvindex.api.tokenize.chat_template import ChatTemplate
from kvindex.api.tokenize.local import LocalTokenizer
from kvindex.api.tokenize.protocol import Tallied
from kvindex.api.tokenize.renderers import ProbeAnswer, Renderers
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import OpKind, PrefixMatch
from tests.support.tokenizer_kinds import KINDS


def samples(metrics: ApiMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


# --- what an API process exports of its own, and what it leaves to the indexer ----------

WRITE_PATH_SERIES = ("kvindex_batches_total", "kvindex_blocks", "kvindex_replicas")


def names(metrics: ApiMetrics) -> set[str]:
    return {name for name, _ in samples(metrics)}


def test_an_api_only_process_leaves_the_fleet_series_to_the_indexer() -> None:
    """Each API pod exporting the fleet's counters makes sum() count them once per pod."""
    registry = Registry((ReplicaSpec("r1", "m"),))
    registry.record(StreamId("r1"), StreamReport(num_batches=5))
    api_only = names(ApiMetrics(registry, MemoryIndex(), runs_write_path=False))
    with_indexer = names(ApiMetrics(registry, MemoryIndex(), runs_write_path=True))
    for series in WRITE_PATH_SERIES:
        assert series not in api_only, series
        assert series in with_indexer, series


def test_store_up_follows_the_circuit_and_build_info_names_the_version() -> None:
    registry = Registry(())
    up = [True]
    metrics = ApiMetrics(registry, MemoryIndex(), store_up=lambda: up[0])
    assert samples(metrics)[("kvindex_api_store_up", ())] == 1
    up[0] = False
    assert samples(metrics)[("kvindex_api_store_up", ())] == 0
    build = (("component", "api"), ("version", kvindex.__version__))
    assert samples(metrics)[("kvindex_build_info", build)] == 1


def test_degraded_reasons_are_exported_from_zero() -> None:
    metrics = ApiMetrics(Registry(()), MemoryIndex())
    metrics.degraded_answers.labels("fleet_unreadable").inc()
    found = samples(metrics)
    assert found[("kvindex_degraded_answers_total", (("reason", "index_unavailable"),))] == 0
    assert found[("kvindex_degraded_answers_total", (("reason", "fleet_unreadable"),))] == 1


def test_each_rule_counts_the_answers_it_matched_from_zero() -> None:
    metrics = ApiMetrics(Registry(()), MemoryIndex(), rule_names=["batch", "acme"])
    metrics.count_rule("acme")
    metrics.count_rule("acme")
    metrics.count_rule(None)
    found = samples(metrics)
    rules = {
        labels: v
        for (name, labels), v in found.items()
        if name == "kvindex_score_rule_matches_total"
    }
    assert rules == {(("rule", "batch"),): 0, (("rule", "acme"),): 2}


def test_block_size_mismatches_are_counted_per_model() -> None:
    registry = Registry(
        (ReplicaSpec("a", "m"), ReplicaSpec("b", "m"), ReplicaSpec("c", "m"), ReplicaSpec("d", "n"))
    )
    for replica, size in (("a", 16), ("b", 16), ("c", 32), ("d", 16)):
        registry.record(StreamId(replica), StreamReport(block_size=size))
    check = BlockSizeCheck(ApiSettings(), registry)
    found = samples(ApiMetrics(registry, MemoryIndex(), block_sizes=check))
    assert found[("kvindex_block_size_mismatch_streams", (("model", "m"),))] == 1
    assert found[("kvindex_block_size_mismatch_streams", (("model", "n"),))] == 0


def test_the_timed_index_times_a_holders_lookup_and_answers_the_inner_holders() -> None:
    index, registry = MemoryIndex(), Registry()
    metrics = ApiMetrics(registry, index)
    stream = StreamId("r1")
    index.apply(stream, 0, 1.0, [(OpKind.STORE, Tier.GPU, 1, 101)])
    timed = TimedIndex(index, metrics.lookup_latency)
    assert timed.holders([101, 102], [StreamId("r0"), stream]) == [(PrefixMatch((Tier.GPU,)), [1])]
    assert samples(metrics)[("kvindex_lookup_seconds_count", ())] == 1


@dataclass
class _Views:
    """What the collector reads of ``FleetTokenizers``."""

    kept: list[Renderers]
    hub: dict[str, str]
    local: list[tuple[str, Tallied]] = field(default_factory=list)

    def renderers(self) -> list[Renderers]:
        return self.kept

    def hub_verdicts(self) -> dict[str, str]:
        return self.hub

    def locals(self) -> list[tuple[str, Tallied]]:
        return self.local


def test_the_tokenizer_collector_shows_each_models_verdicts_and_answers() -> None:
    async def probe(_url: str) -> ProbeAnswer:
        return ((1,), None)

    async def run() -> bytes:
        renderers = Renderers("m", probe)
        replicas = [("r1", "http://r1:8000"), ("r2", "http://r2:8000")]
        renderers.order(replicas, 1)
        renderers.answered(replicas[1])
        renderers.answered(replicas[1])
        await renderers.aclose()
        registry = CollectorRegistry()
        registry.register(TokenizerCollector(_Views([renderers], {"org/h": "differs"})))
        return generate_latest(registry)

    text = asyncio.run(run()).decode()
    assert 'kvindex_tokenizer_hub{model="org/h",verdict="differs"} 1.0' in text
    assert 'kvindex_tokenizer_replicas{model="m",verdict="agrees"} 1.0' in text
    assert 'kvindex_tokenizer_replicas{model="m",verdict="unvetted"} 1.0' in text
    assert 'kvindex_tokenizer_answers_total{model="m",replica="r2"} 2.0' in text
    assert 'replica="r1"' not in text


def test_the_tokenizer_collector_shows_how_a_local_tokenizer_answered() -> None:
    """A tokenizer in process behind its cache: each text counted by how it was encoded, and
    which of its shortcuts are on (Chinese prose is cut before its punctuation)."""
    tok, template, specials = KINDS["byte_level_bpe"]()
    cached = CachingTokenizer(LocalTokenizer(tok, ChatTemplate(template, special_tokens=specials)))
    document = "今天天气很好\uff0c我们去公园散步。" * 200

    async def run() -> None:
        for prompt in (document, document + "明天呢", document + "明天呢", document + "后天"):
            await cached.encode_prompt(prompt)

    asyncio.run(run())
    registry = CollectorRegistry()
    registry.register(TokenizerCollector(_Views([], {}, [("m", cached)])))
    text = generate_latest(registry).decode()
    for kind, count in {"cached": 1, "reused": 2, "anchored": 3, "fast": 3, "mismatch": 0}.items():
        assert f'kvindex_tokenizer_local_texts_total{{kind="{kind}",model="m"}} {count}.0' in text
    features = ("fast_path", "heads", "anchors", "split_words", "split_punctuation", "word_heads")
    for feature in features:
        assert f'kvindex_tokenizer_local_features{{feature="{feature}",model="m"}} 1.0' in text
