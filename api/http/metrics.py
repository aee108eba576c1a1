"""Prometheus metrics of one API process: a per-app registry, never the global one."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvindex.api.answer import DEGRADED_REASONS
from kvindex.api.health.block_sizes import BlockSizeCheck
from kvindex.api.http.tally import Tally, Timings
from kvindex.api.tokenize.protocol import Tallied
from kvindex.api.tokenize.renderers import Renderers
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.fleet.registry import RegistryView
from kvindex.indexer.index.protocol import BlockIndex, HeldRuns, PrefixMatch
from kvindex.indexer.index.wrapper import IndexWrapper
from kvindex.indexer.metrics import BuildInfo, IngestCollector

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
_HTTP_BUCKETS = (*_LATENCY_BUCKETS, 1.0, 2.5, 10.0)
UNMATCHED_ROUTE = "unmatched"
"""The ``route`` label of a request no route matched (its raw path would be unbounded)."""


class ApiMetrics:
    def __init__(
        self,
        registry: RegistryView,
        index: BlockIndex,
        *,
        runs_write_path: bool = True,
        store_up: Callable[[], bool] = lambda: True,
        block_sizes: BlockSizeCheck | None = None,
        rule_names: Sequence[str] = (),
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.tally = Tally()  # registered first: collected before the series it adds to
        self.registry.register(self.tally)
        self._request_series()
        self._score_series()
        self._rule_series(rule_names)
        store = Gauge(
            "kvindex_api_store_up",
            "1 while the API calls its store (circuit closed), 0 while it skips it",
            registry=self.registry,
        )
        store.set_function(lambda: 1.0 if store_up() else 0.0)
        self.registry.register(BuildInfo("api"))
        if block_sizes is not None:
            self.watch_block_sizes(block_sizes)
        if runs_write_path:
            self.registry.register(IngestCollector(registry, index))

    def watch_block_sizes(self, check: BlockSizeCheck) -> None:
        self.registry.register(BlockSizeCollector(check))

    def _request_series(self) -> None:
        self.http_requests = Counter(
            "kvindex_http_requests",
            "HTTP answers by route template, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.http_latency = Histogram(
            "kvindex_http_request_seconds",
            "Time to answer an HTTP request, by route template",
            ["route"],
            buckets=_HTTP_BUCKETS,
            registry=self.registry,
        )

    def _score_series(self) -> None:
        self.score_latency = Histogram(
            "kvindex_score_seconds",
            "Time to answer POST /score",
            ["policy"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.lookup_latency = lookup_latency(self.registry)
        self.degraded_answers = Counter(
            "kvindex_degraded_answers",
            "POST /score answers marked degraded, by reason",
            ["reason"],
            registry=self.registry,
        )
        for reason in DEGRADED_REASONS:  # present from the start, so rate() sees the first
            self.degraded_answers.labels(reason)
        self.scrape_failures = Counter(
            "kvindex_load_scrape_failures",
            "Scrapes of a replica's vLLM /metrics that failed",
            ["replica"],
            registry=self.registry,
        )

    def _rule_series(self, rule_names: Sequence[str]) -> None:
        self.rule_matches = Counter(
            "kvindex_score_rule_matches",
            "POST /score answers by the [[rules]] entry that matched the request",
            ["rule"],
            registry=self.registry,
        )
        for name in rule_names:  # present from the start, so rate() sees the first
            self.rule_matches.labels(name)

    def count_rule(self, rule: str | None) -> None:
        """One /score answer and the rule it matched (None: no rule, not counted)."""
        if rule is not None:
            self.rule_matches.labels(rule).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def lookup_latency(registry: CollectorRegistry) -> Histogram:
    """``kvindex_lookup_seconds`` on ``registry``: the API's and the proxy's (via TimedIndex)."""
    return Histogram(
        "kvindex_lookup_seconds",
        "Time of one index longest-prefix lookup",
        buckets=_LATENCY_BUCKETS,
        registry=registry,
    )


class BlockSizeCollector(Collector):
    """``kvindex_block_size_mismatch_streams{model}``, computed when Prometheus scrapes."""

    def __init__(self, check: BlockSizeCheck) -> None:
        self._check = check

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauge = GaugeMetricFamily(
            "kvindex_block_size_mismatch_streams",
            "Streams whose block size differs from their model's (they never match)",
            labels=["model"],
        )
        model_to_count: dict[str, int] = dict.fromkeys(self._check.models(), 0)
        for mismatch in self._check.mismatches().values():
            model_to_count[mismatch.model] = model_to_count.get(mismatch.model, 0) + 1
        for model, count in sorted(model_to_count.items()):
            gauge.add_metric([model], count)
        yield gauge


class TokenizerViews(Protocol):
    """What :class:`TokenizerCollector` reads (``FleetTokenizers``)."""

    def renderers(self) -> Iterable[Renderers]: ...
    def hub_verdicts(self) -> dict[str, str]: ...
    def locals(self) -> Iterable[tuple[str, Tallied]]: ...


class TokenizerCollector(Collector):
    """Replica tokenizers by verdict, the calls each answered, hub tokenizers' checks."""

    def __init__(self, tokenizers: TokenizerViews) -> None:
        self._tokenizers = tokenizers

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        replicas = GaugeMetricFamily(
            "kvindex_tokenizer_replicas",
            "Replicas of a replica-tokenized model by verdict: agrees (asked in turn), differs"
            " (its probe ids are not the reference's: never asked), unvetted (asked last).",
            labels=["model", "verdict"],
        )
        answers = CounterMetricFamily(
            "kvindex_tokenizer_answers",
            "Tokenize or render calls a replica answered for the router.",
            labels=["model", "replica"],
        )
        hub = GaugeMetricFamily(
            "kvindex_tokenizer_hub",
            "A model tokenized by its tokenizer.json from the Hugging Face hub cache, by its"
            " check against a replica: agrees, differs (its replicas tokenize it), unchecked.",
            labels=["model", "verdict"],
        )
        for renderers in self._tokenizers.renderers():
            for verdict, count in sorted(renderers.verdicts().items()):
                replicas.add_metric([renderers.model, verdict], count)
            for replica, count in sorted(renderers.num_answers.items()):
                answers.add_metric([renderers.model, replica], count)
        for model, checked in sorted(self._tokenizers.hub_verdicts().items()):
            hub.add_metric([model, checked], 1)
        yield replicas
        yield answers
        yield hub
        yield from _local_tallies(self._tokenizers.locals())


def _local_tallies(
    locals_: Iterable[tuple[str, Tallied]],
) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    texts = CounterMetricFamily(
        "kvindex_tokenizer_local_texts",
        "Texts a tokenizer in process answered, by how: cached (whole, from its cache), reused"
        " (encoded from a kept start), anchored (a prompt cut at anchors), head (a head handed"
        " out first), fast (by the fast path); mismatch: checks that found ids differing.",
        labels=["model", "kind"],
    )
    features = GaugeMetricFamily(
        "kvindex_tokenizer_local_features",
        "1 when a tokenizer in process has a shortcut on: fast_path, heads, anchors, split_words,"
        " split_punctuation, word_heads (a mismatch turns the first three off for good).",
        labels=["model", "feature"],
    )
    for model, tallied in sorted(locals_, key=lambda pair: pair[0]):
        for kind, count in tallied.tallies().items():
            texts.add_metric([model, kind], count)
        for feature, on in tallied.features().items():
            features.add_metric([model, feature], int(on))
    yield texts
    yield features


class TimedIndex(IndexWrapper):
    """A BlockIndex that times lookups; everything else passes through."""

    def __init__(self, inner: BlockIndex, histogram: Histogram | Timings) -> None:
        super().__init__(inner)
        self._histogram = histogram

    def longest_prefix(
        self, keys: Sequence[int], streams: Iterable[StreamId]
    ) -> dict[StreamId, PrefixMatch]:
        started = time.perf_counter()
        try:
            return self._inner.longest_prefix(keys, streams)
        finally:
            self._histogram.observe(time.perf_counter() - started)

    def holders(self, keys: Sequence[int], streams: Sequence[StreamId]) -> HeldRuns:
        started = time.perf_counter()
        try:
            return self._holders(keys, streams)
        finally:
            self._histogram.observe(time.perf_counter() - started)
