"""kvindex.api.http.views: the read-only bodies from an in-process registry, index and load store.

The served JSON is pinned by tests/integration/test_api.py; these tests pin what each view
gathers: a replica's worst stream state, blocks by tier, its load, the fleet totals.
"""

from __future__ import annotations

import time
from typing import Any

from kvindex.api.config.settings import ApiSettings, ModelSpec, load_api_settings
from kvindex.api.decision.policies import Weights
from kvindex.api.health.block_sizes import BlockSizeCheck
from kvindex.api.http.views import config_view, replica_views, stats_view
from kvindex.api.load.model import Load
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.schemas import ModelView, ReplicaView
from kvindex.api.score import Scorer
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import Op, OpKind


def fleet() -> tuple[Registry, MemoryIndex, MemoryLoadStore]:
    """``a`` (two ranks: rank 0 heard, holding 2 GPU blocks and 1 CPU block) and ``b``
    (never heard of); ``a`` has a pushed load."""
    registry = Registry((ReplicaSpec("a", "m", dp_size=2), ReplicaSpec("b", "m")))
    index = MemoryIndex()
    stream = StreamId("a", 0)
    ops: list[Op] = [
        (OpKind.STORE, Tier.GPU, 1, 11),
        (OpKind.STORE, Tier.GPU, 2, 12),
        (OpKind.STORE, Tier.CPU, 3, 13),
    ]
    index.apply(stream, 0, time.time(), ops)
    registry.record(stream, StreamReport(last_seq=0, last_event_ts=time.time()))
    loads = MemoryLoadStore()
    loads.put("a", Load(2.0, 1.0, 0.5, time.time(), "push"))
    return registry, index, loads


def views_of(
    registry: Registry, index: MemoryIndex, loads: MemoryLoadStore, settings: ApiSettings
) -> list[ReplicaView]:
    return replica_views(registry, index, loads, BlockSizeCheck(settings, registry))


def test_replica_views_gather_streams_blocks_and_load() -> None:
    a, b = views_of(*fleet(), ApiSettings())
    assert (a.id, a.state, a.dp_size) == ("a", "live", 2)
    (stream,) = a.streams
    assert (stream.rank, stream.last_seq, stream.freshness.state) == (0, 0, "live")
    assert stream.blocks == {"gpu": 2, "cpu": 1, "other": 0}
    assert stream.counters["decode_errors"] == stream.counters["store_errors"] == 0
    assert a.load is not None
    assert (a.load.running, a.load.waiting, a.load.source) == (2.0, 1.0, "push")
    assert 0.0 <= a.load.age_s < 60.0
    assert (b.id, b.state, b.streams, b.load) == ("b", "stale", [], None)  # never heard of


def test_stats_view_totals_the_fleet() -> None:
    registry, index, _ = fleet()
    stats = stats_view(registry, index)
    assert (stats.replicas, stats.streams) == (2, 1)
    assert stats.blocks == {"gpu": 2, "cpu": 1, "other": 0}


def test_config_view_lists_every_known_model_with_its_block_size() -> None:
    registry, index, loads = fleet()
    settings = ApiSettings(default_policy="least_load", models=(ModelSpec("n", block_size=32),))
    scorer = Scorer(
        settings, index, registry, loads, tokenizers=lambda _: None, blocking_store=False
    )
    config = config_view(settings, scorer)
    assert config.default_policy == "least_load"
    assert config.weights == Weights().as_dict()
    assert config.models == {"m": ModelView(16), "n": ModelView(32)}
    assert config.rules == []


def test_config_view_lists_the_routing_rules_in_order() -> None:
    registry, index, loads = fleet()
    tables: list[dict[str, Any]] = [
        {"name": "batch", "workload": ["batch"], "policy": "least_load"},
        {"name": "acme", "headers": {"x-tenant": ["acme"]}, "weights": {"waiting": 0.3}},
    ]
    settings = load_api_settings(None, None, rules=list(tables), env={})
    scorer = Scorer(
        settings, index, registry, loads, tokenizers=lambda _: None, blocking_store=False
    )
    assert config_view(settings, scorer).rules == tables


def test_each_stream_shows_its_block_size_and_a_mismatch_is_flagged() -> None:
    """``c`` publishes 32-token blocks where its model's other streams use 16: flagged."""
    registry = Registry((ReplicaSpec("a", "m"), ReplicaSpec("b", "m"), ReplicaSpec("c", "m")))
    for replica, size in (("a", 16), ("b", 16), ("c", 32)):
        registry.record(StreamId(replica), StreamReport(block_size=size, last_seq=0))
    views = views_of(registry, MemoryIndex(), MemoryLoadStore(), ApiSettings())
    shown = {v.id: (v.streams[0].block_size, v.streams[0].block_size_mismatch) for v in views}
    assert shown == {"a": (16, False), "b": (16, False), "c": (32, True)}


def test_a_configured_block_size_is_what_streams_are_held_to() -> None:
    registry = Registry((ReplicaSpec("a", "m"), ReplicaSpec("b", "m")))
    registry.record(StreamId("a"), StreamReport(block_size=16, last_seq=0))
    registry.record(StreamId("b"), StreamReport(last_seq=0))  # no size seen yet
    settings = ApiSettings(models=(ModelSpec("m", block_size=32),))
    a, b = views_of(registry, MemoryIndex(), MemoryLoadStore(), settings)
    assert (a.streams[0].block_size, a.streams[0].block_size_mismatch) == (16, True)
    assert (b.streams[0].block_size, b.streams[0].block_size_mismatch) == (None, False)
