"""kvindex.indexer.domain.events: tier folding, stream ids and llm-d's topic convention."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.indexer.domain.events import StreamId, Tier, Topic


def test_tier_values_are_stable() -> None:
    # Stored in Redis: renumbering would misread every existing entry.
    assert [(t.name, t.value) for t in Tier] == [("GPU", 0), ("CPU", 1), ("OTHER", 2)]


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        (None, Tier.GPU),
        ("GPU", Tier.GPU),
        ("gpu", Tier.GPU),
        ("Gpu", Tier.GPU),
        ("CPU", Tier.CPU),
        ("cpu", Tier.CPU),
        ("Cpu", Tier.CPU),
        ("STORAGE", Tier.OTHER),
        ("FS", Tier.OTHER),
        ("OBJ", Tier.OTHER),
        ("", Tier.OTHER),
        (" gpu", Tier.OTHER),
    ],
)
def test_tier_from_medium(medium: str | None, tier: Tier) -> None:
    assert Tier.from_medium(medium) is tier


@pytest.mark.parametrize(
    ("stream", "text"),
    [
        (StreamId("pod-a", 0), "pod-a/0"),
        (StreamId("pod-a", 3), "pod-a/3"),
        (StreamId("10.0.0.7:5557", 1), "10.0.0.7:5557/1"),
        (StreamId("ns/pod-a", 2), "ns/pod-a/2"),
        (StreamId("", 0), "/0"),
    ],
)
def test_stream_id_str_and_parse(stream: StreamId, text: str) -> None:
    assert str(stream) == text
    assert StreamId.parse(text) == stream


def test_stream_id_without_rank_is_rank_zero() -> None:
    assert StreamId.parse("pod-a") == StreamId("pod-a", 0)
    assert StreamId("pod-a") == StreamId("pod-a", 0)


def test_stream_ids_order_by_replica_then_rank() -> None:
    streams = [StreamId("b", 0), StreamId("a", 1), StreamId("a", 0)]
    assert sorted(streams) == [StreamId("a", 0), StreamId("a", 1), StreamId("b", 0)]


@settings(max_examples=200, deadline=None, database=None)
@given(replica=st.text(max_size=20), rank=st.integers(0, 1 << 16))
def test_stream_id_round_trips(replica: str, rank: int) -> None:
    stream = StreamId(replica, rank)
    assert StreamId.parse(str(stream)) == stream


def test_topic_in_llm_d_convention() -> None:
    topic = Topic.parse("kv@pod-a@demo-model")
    assert topic == Topic("kv@pod-a@demo-model", "pod-a", "demo-model")


def test_topic_with_empty_model_has_no_model() -> None:
    assert Topic.parse("kv@pod-a@") == Topic("kv@pod-a@", "pod-a", None)


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "kv-events",
        "kv@pod-a",
        "kv@@demo-model",
        "xx@pod-a@demo-model",
        "kv@pod-a@demo-model@extra",
        "KV@pod-a@demo-model",
    ],
)
def test_other_topics_have_no_replica(raw: str) -> None:
    topic = Topic.parse(raw)
    assert (topic.raw, topic.replica, topic.model) == (raw, None, None)
