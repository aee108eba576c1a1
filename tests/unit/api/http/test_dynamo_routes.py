"""Dynamo's standalone-indexer routes over a memory index: registration as replicas, the
answers in Dynamo's shapes, and every bad body a 4xx with ``{"error": ...}``."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient

from kvindex.api.config.settings import ApiSettings
from kvindex.api.dynamo.instances import instance_of_name
from kvindex.api.http.app import create_app
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.runtime import ApiDeps
from kvindex.indexer.domain.events import BlockStored, StreamId, Tier
from kvindex.indexer.domain.keys import block_keys
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.block_journal import BlockJournal, JournaledIndex, tokens_hash
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import OpKind

SETTINGS = ApiSettings(scrape_interval_s=0.0, health_check_interval_s=0.0)
TOKENS = list(range(100, 164))  # 4 blocks of 16


@pytest.fixture
def parts() -> tuple[TestClient, MemoryIndex, Registry]:
    index, registry = MemoryIndex(), Registry((ReplicaSpec("r1", "m"),))
    deps = ApiDeps(SETTINGS, index, registry, MemoryLoadStore(), blocking_store=False)
    return TestClient(create_app(deps)), index, registry


def _register(client: TestClient, instance: int, rank: int = 0, **extra: Any) -> Any:
    body = {
        "instance_id": instance,
        "endpoint": f"tcp://127.0.0.1:{5600 + rank}",
        "model_name": "m",
        "block_size": 16,
        "dp_rank": rank,
        **extra,
    }
    return client.post("/register", json=body)


def _store(index: MemoryIndex, stream: StreamId, num_blocks: int, tier: Tier = Tier.GPU) -> None:
    keys = block_keys("m", TOKENS, 16)[:num_blocks]
    index.apply(
        stream,
        index.stats(stream).watermark + 1,
        0.0,
        [(OpKind.STORE, tier, 1000 + i, k) for i, k in enumerate(keys)],
    )


def test_registered_ranks_are_replicas_and_workers(
    parts: tuple[TestClient, MemoryIndex, Registry],
) -> None:
    client, _, registry = parts
    assert _register(client, 5).status_code == 201
    assert _register(client, 5, 1).json() == {"status": "ok"}
    assert registry.get("dynamo-5") is not None and registry.get("dynamo-5.dp1") is not None
    workers = {w["instance_id"]: w for w in client.get("/workers").json()}
    assert workers[5]["endpoints"] == {"0": "tcp://127.0.0.1:5600", "1": "tcp://127.0.0.1:5601"}
    assert workers[5]["listeners"]["1"] == {"endpoint": "tcp://127.0.0.1:5601", "status": "active"}
    assert (workers[5]["model_name"], workers[5]["routing_group"], workers[5]["block_size"]) == (
        "m",
        "default",
        16,
    )
    assert len(workers) == 2  # and r1, under its numeric id


def test_query_answers_per_instance_rank_and_tier(
    parts: tuple[TestClient, MemoryIndex, Registry],
) -> None:
    client, index, _ = parts
    _register(client, 5)
    _register(client, 5, 1)
    _store(index, StreamId("dynamo-5"), 3)
    _store(index, StreamId("dynamo-5.dp1"), 4, Tier.CPU)
    answer = client.post("/query", json={"token_ids": TOKENS, "model_name": "m"}).json()
    assert answer["scores"] == {"5": {"0": 48}}
    assert answer["frequencies"] == [1, 1, 1]
    assert answer["instances"]["5"] == {
        "longest_matched": 64,
        "gpu": 48,
        "dp": {"0": 48, "1": 0},
        "cpu": 64,
        "disk": 64,
    }
    keys = block_keys("m", TOKENS, 16)
    signed = [k - (1 << 64) if k >= 1 << 63 else k for k in keys]
    for given in (keys, signed):
        by_hash = client.post("/query_by_hash", json={"block_hashes": given, "model_name": "m"})
        assert by_hash.json() == answer
    other = client.post("/query", json={"token_ids": TOKENS, "model_name": "m", "lora_name": "a"})
    assert other.json() == {"scores": {}, "frequencies": [], "instances": {}}


def test_unregister_drops_the_rank_named_or_every_rank(
    parts: tuple[TestClient, MemoryIndex, Registry],
) -> None:
    client, index, registry = parts
    _register(client, 5)
    _register(client, 5, 1)
    _store(index, StreamId("dynamo-5.dp1"), 2)
    assert (
        client.post(
            "/unregister", json={"instance_id": 5, "model_name": "m", "dp_rank": 1}
        ).status_code
        == 200
    )
    assert registry.get("dynamo-5.dp1") is None and registry.get("dynamo-5") is not None
    assert StreamId("dynamo-5.dp1") not in index.streams()
    assert client.post("/unregister", json={"instance_id": 5, "model_name": "m"}).status_code == 200
    assert registry.get("dynamo-5") is None
    gone = client.post("/unregister", json={"instance_id": 5, "model_name": "m"})
    assert (gone.status_code, gone.json()) == (404, {"error": "instance 5 not found"})


def test_conflicts_answer_as_dynamos(parts: tuple[TestClient, MemoryIndex, Registry]) -> None:
    client, _, _ = parts
    _register(client, 5)
    again = _register(client, 5)
    assert (again.status_code, again.json()) == (
        409,
        {"error": "instance 5 dp_rank 0 already registered"},
    )
    assert _register(client, 6, block_size=4).status_code == 409
    unknown = client.post("/query", json={"token_ids": [1], "model_name": "x"})
    assert (unknown.status_code, unknown.json()) == (
        404,
        {"error": "no indexer for model=x routing_group=default"},
    )


HOSTILE: list[tuple[str, Any]] = [
    ("/register", b"{"),
    ("/register", b"[]"),
    (
        "/register",
        {"instance_id": -1, "endpoint": "tcp://h:1", "model_name": "m", "block_size": 16},
    ),
    (
        "/register",
        {"instance_id": 2**64, "endpoint": "tcp://h:1", "model_name": "m", "block_size": 16},
    ),
    (
        "/register",
        {"instance_id": 1, "endpoint": "http://h:1", "model_name": "m", "block_size": 16},
    ),
    ("/register", {"instance_id": 1, "endpoint": "tcp://h:1", "model_name": "", "block_size": 16}),
    ("/register", {"instance_id": 1, "endpoint": "tcp://h:1", "model_name": "m", "block_size": 0}),
    (
        "/register",
        {
            "instance_id": 1,
            "endpoint": "tcp://h:1",
            "model_name": "m",
            "block_size": 16,
            "dp_rank": 10**6,
        },
    ),
    (
        "/register",
        {
            "instance_id": 1,
            "endpoint": "tcp://h:1",
            "model_name": "m",
            "block_size": 16,
            "routing_group": "g",
        },
    ),
    (
        "/register",
        {"instance_id": 1, "endpoint": "tcp://h:1", "model_name": "m" * 300, "block_size": 16},
    ),
    ("/unregister", {"instance_id": "x", "model_name": "m"}),
    ("/unregister", {"instance_id": 1}),
    ("/query", {"token_ids": [-1], "model_name": "m"}),
    ("/query", {"token_ids": [2**32], "model_name": "m"}),
    ("/query", {"token_ids": "abc", "model_name": "m"}),
    ("/query", {"model_name": "m"}),
    ("/query", b"[" * 100_000),
    ("/query", {"token_ids": [1], "model_name": "m", "routing_group": "g"}),
    ("/query_by_hash", {"block_hashes": [2**64], "model_name": "m"}),
    ("/query_by_hash", {"block_hashes": [-(2**63) - 1], "model_name": "m"}),
    ("/query_by_hash", {"block_hashes": [1.5], "model_name": "m"}),
]


@pytest.mark.parametrize(("path", "body"), HOSTILE)
def test_bad_bodies_are_4xx_with_an_error(
    parts: tuple[TestClient, MemoryIndex, Registry], path: str, body: Any
) -> None:
    client, _, _ = parts
    sent = (
        client.post(path, content=body) if isinstance(body, bytes) else client.post(path, json=body)
    )
    assert 400 <= sent.status_code < 500, sent.text
    assert isinstance(sent.json()["error"], str)
    route = f'kvindex_dynamo_refusals_total{{route="{path}"}} 1.0'
    assert route in client.get("/metrics").text


def test_dump_answers_in_dynamos_format_only_with_the_journal() -> None:
    journal = BlockJournal()
    index, registry = JournaledIndex(MemoryIndex(), journal), Registry()
    deps = ApiDeps(SETTINGS, index, registry, MemoryLoadStore(), blocking_store=False)
    client = TestClient(create_app(deps))
    _register(client, 5, 1)
    index.observe_event(
        StreamId("dynamo-5.dp1"), BlockStored([7, 8], None, TOKENS[:32], 16, Tier.GPU)
    )
    index.observe_event(StreamId("gone"), BlockStored([9], None, TOKENS[:16], 16, Tier.GPU))
    dumped = client.get("/dump").json()
    HASHED = tokens_hash(TOKENS[:16])  # noqa: N806
    assert list(dumped) == ["m:default"] and dumped["m:default"]["block_size"] == 16
    first, second = dumped["m:default"]["events"]
    assert first == {
        "worker_id": 5, "storage_tier": "device", "residency_domain": "worker", "event": {
            "event_id": 0, "dp_rank": 1, "data": {"stored": {
                "parent_hash": None, "start_position": None,
                "blocks": [{"block_hash": 7, "tokens_hash": HASHED, "mm_extra_info": None}],
            }},
        },
    }  # fmt: skip
    assert second["event"]["data"]["stored"]["parent_hash"] == 7
    without = TestClient(
        create_app(
            ApiDeps(SETTINGS, MemoryIndex(), Registry(), MemoryLoadStore(), blocking_store=False)
        )
    )
    assert without.get("/dump").status_code == 404


def test_kvindex_replicas_show_and_unregister_under_their_numeric_id(
    parts: tuple[TestClient, MemoryIndex, Registry],
) -> None:
    client, _, registry = parts
    registry.add(ReplicaSpec("r2", "m", events="tcp://127.0.0.1:5700", dp_size=2))
    workers = {w["instance_id"]: w for w in client.get("/workers").json()}
    r1, r2 = instance_of_name("r1"), instance_of_name("r2")
    assert workers[r2]["endpoints"] == {"0": "tcp://127.0.0.1:5700", "1": "tcp://127.0.0.1:5701"}
    assert workers[r1]["endpoints"] == {"0": None}
    one_rank = client.post("/unregister", json={"instance_id": r2, "model_name": "m", "dp_rank": 1})
    assert one_rank.status_code == 422 and "omit dp_rank" in one_rank.json()["error"]
    assert (
        client.post("/unregister", json={"instance_id": r2, "model_name": "m"}).status_code == 200
    )
    assert registry.get("r2") is None
