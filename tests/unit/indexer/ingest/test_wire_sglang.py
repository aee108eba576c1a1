"""kvindex.indexer.ingest.wire on SGLang's frames: the golden capture of SGLang 0.5.23's own
``ZmqEventPublisher`` (tests/fixtures/PROVENANCE.md), every vector decoded field by field, on
the Python path and the compiled one; never skipped."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import msgspec
import pytest

from kvindex.indexer.domain.events import BlockRemoved, BlockStored, Event, Tier
from kvindex.indexer.domain.keys import request_extra_keys
from kvindex.indexer.ingest.wire import (
    END_SEQ,
    BlockStoredMap,
    decode_live,
    decode_live_native,
    decode_replay,
    encode_replay_request,
    payload_producer,
    salted_extra_keys,
)
from tests.support.paths import FIXTURES

NAME = "sglang-0.5.23-kv-events.json"
SHA256 = "5b073e8b8fd2da9e015dfcd815d8d90cb5c24a58f5a7306921941faf98e702f2"
CAPTURE: dict[str, Any] = json.loads((FIXTURES / NAME).read_text(encoding="utf-8"))
U64 = 1 << 64
TIERS = {"GPU": Tier.GPU, "CPU_PINNED": Tier.CPU}


def _frames(vector: dict[str, Any]) -> list[bytes]:
    return [base64.b64decode(f) for f in vector["frames_b64"]]


def _params(channel: str) -> list[Any]:
    chosen = [v for v in CAPTURE["vectors"] if v["channel"] == channel]
    return [pytest.param(v, id=v["id"]) for v in chosen]


def _expected(raw: dict[str, Any]) -> dict[str, Any]:
    """What kvindex must read of a recorded event (a vLLM-equivalent view)."""
    tag = raw["type"]
    if tag == "AllBlocksCleared":
        return {"type": tag}
    view = {
        "type": tag,
        "block_hashes": [h % U64 for h in raw["block_hashes"]],
        "tier": TIERS[raw["medium"]],
    }
    if tag == "BlockStored":
        parent = raw.get("parent_block_hash")
        salt = raw.get("cache_salt")
        extras = None
        if salt is not None:  # vLLM's per-block rule for the request's extra keys
            root_salt = salt if parent is None else None
            extras = request_extra_keys(len(raw["block_hashes"]), raw.get("lora_name"), root_salt)
        view |= {
            "parent_hash": None if parent is None else parent % U64,
            "token_ids": raw["token_ids"],
            "block_size": raw["block_size"],
            "lora_name": raw.get("lora_name"),
            "extra_keys": None if extras is None else tuple(extras),
        }
    return view


def _actual(event: Event) -> dict[str, Any]:
    view: dict[str, Any] = {"type": type(event).__name__}
    if isinstance(event, BlockStored | BlockRemoved):
        view |= {"block_hashes": list(event.block_hashes), "tier": event.tier}
    if isinstance(event, BlockStored):
        view |= {
            "parent_hash": event.parent_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_name": event.lora_name,
            "extra_keys": event.extra_keys,
        }
    return view


def _assert_matches(vector: dict[str, Any], seq: int, ts: float, rank: int, events: Any) -> None:
    recorded_ts, raw_events, recorded_rank = vector["payload_decoded"]
    assert (seq, ts, rank) == (vector["seq"], recorded_ts, recorded_rank)
    assert [type(e).__name__ for e in events] == vector["event_types"]
    assert [_actual(e) for e in events] == [_expected(e) for e in raw_events]


def test_fixture_is_the_unedited_capture() -> None:
    assert hashlib.sha256((FIXTURES / NAME).read_bytes()).hexdigest() == SHA256


def test_fixture_has_every_vector() -> None:
    channels = [v["channel"] for v in CAPTURE["vectors"]]
    assert (channels.count("pub"), channels.count("replay-reply")) == (9, 9)
    fields = CAPTURE["meta"]["struct_fields"]
    assert fields["EventBatch"] == ["ts", "events", "attn_dp_rank"]
    assert fields["BlockStored"][6:] == ["cache_salt", "session_id", "lora_name"]
    stored = [
        e
        for v in _params("pub")
        for e in v.values[0]["payload_decoded"][1]
        if e["type"] == "BlockStored"
    ]
    assert {"cache_salt", "session_id", "lora_name"} <= {k for e in stored for k in e}
    assert any(h < 0 for e in stored for h in e["block_hashes"])  # signed int64 hashes


@pytest.mark.parametrize("vector", _params("pub"))
def test_live_vector_decodes_to_recorded_content(vector: dict[str, Any]) -> None:
    message = decode_live(_frames(vector))
    assert message.topic == vector["topic"] == CAPTURE["meta"]["topic"]
    batch = message.batch
    assert batch.num_bad_events == 0
    _assert_matches(vector, batch.seq, batch.ts, batch.rank, batch.events)


@pytest.mark.parametrize("vector", _params("pub"))
def test_the_compiled_path_reads_what_the_python_path_reads(vector: dict[str, Any]) -> None:
    """It takes the plain stores, the host-memory ones, removals and clears; it leaves the
    salted and LoRA stores (extra keys) to the Python path."""
    frames = _frames(vector)
    native = decode_live_native(frames)
    events = vector["payload_decoded"][1]
    has_extras = any("cache_salt" in e or "lora_name" in e for e in events)
    assert (native is None) == has_extras
    if native is not None:
        batch = decode_live(frames).batch
        assert (native.seq, native.ts, native.rank) == (batch.seq, batch.ts, batch.rank)
        assert native.num_events == len(batch.events)
        records = native.records()
        for record, event in zip(records, batch.events, strict=True):
            if isinstance(event, BlockStored):
                assert record == (
                    "store",
                    int(event.tier),
                    event.parent_hash,
                    event.block_size,
                    list(event.token_ids),
                    tuple(event.block_hashes),
                )
            elif isinstance(event, BlockRemoved):
                assert record == ("remove", int(event.tier), tuple(event.block_hashes))
            else:
                assert record == ("clear",)


@pytest.mark.parametrize("vector", _params("replay-reply"))
def test_replay_vector_decodes_to_recorded_content(vector: dict[str, Any]) -> None:
    delimited = vector["id"] != "replay-reply-via-REQ"
    reply = decode_replay(_frames(vector), delimited=delimited)
    assert reply.seq == vector["seq"]
    assert reply.is_end == (vector["seq"] == END_SEQ)
    assert reply.topic == vector["topic"]  # SGLang's replies carry the topic, as vLLM ≥ 0.26
    if reply.batch is not None:
        batch = reply.batch
        _assert_matches(vector, batch.seq, batch.ts, batch.rank, batch.events)


def test_replay_request_is_what_kvindex_sends() -> None:
    (vector,) = [v for v in CAPTURE["vectors"] if v["channel"] == "replay-request"]
    assert encode_replay_request(vector["seq"]) == _frames(vector)


def test_rank_one_publishes_its_rank_in_every_batch() -> None:
    ranks = {
        v["id"]: decode_live(_frames(v)).batch.rank
        for v in CAPTURE["vectors"]
        if v["channel"] == "pub"
    }
    assert {r for i, r in ranks.items() if "rank1" in i} == {1}
    assert {r for i, r in ranks.items() if "rank0" in i} == {0}


@pytest.mark.parametrize(
    ("lora", "salt", "parent", "expected"),
    [
        (None, "s", None, [("s",), None, None]),
        (None, "s", 7, None),
        ("l", "s", None, [("l", "s"), ("l",), ("l",)]),
        ("l", "s", 7, [("l",), ("l",), ("l",)]),
        ("l", None, None, [("l",), ("l",), ("l",)]),
    ],
)
def test_salted_stores_get_vllms_extra_keys(
    lora: str | None, salt: str | None, parent: int | None, expected: list[Any] | None
) -> None:
    event = BlockStoredMap([1, 2, 3], parent, lora_name=lora, cache_salt=salt)
    assert salted_extra_keys(event) == expected
    if parent is None:
        assert expected == request_extra_keys(3, lora, salt)


def test_a_salt_that_is_not_text_costs_only_its_event() -> None:
    good = {"type": "BlockStored", "block_hashes": [1], "token_ids": [5], "block_size": 1}
    bad = good | {"cache_salt": 5}
    payload = msgspec.msgpack.encode([1.0, [bad, good], 0])
    batch = decode_live([b"t", (0).to_bytes(8, "big"), payload]).batch
    assert (len(batch.events), batch.num_bad_events) == (1, 1)


@pytest.mark.parametrize("name", [NAME, "vllm-0.33.0-kv-events.json", "vllm-0.23.0-kv-events.json"])
def test_the_producer_is_told_from_any_captured_store(name: str) -> None:
    vectors = json.loads((FIXTURES / name).read_text(encoding="utf-8"))["vectors"]
    found = set()
    for vector in vectors:
        if vector["channel"] == "pub":
            payload = base64.b64decode(vector["frames_b64"][2])
            stores = [e for e in vector["event_types"] if e == "BlockStored"]
            producer = payload_producer(payload)
            assert producer == ("unknown" if not stores else producer)
            found.add(producer)
    assert found - {"unknown"} == {"SGLang" if name == NAME else "vLLM"}
    assert payload_producer(b"\xc1") == "unknown"
