"""kvindex.indexer.domain.keys: the block-key function, and its agreement with keys ingested from
events.

The agreement tests feed the golden vLLM captures (tests/fixtures) through the real decoder
and Ingestor, then check that a router computing ``block_keys`` from the request's tokens
gets the very keys the index stored.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.indexer.domain import keys as keys_module
from kvindex.indexer.domain.events import BlockStored, StreamId, Topic
from kvindex.indexer.domain.keys import (
    KEY_SCHEME,
    BlockKeyError,
    block_keys,
    chain_keys,
    model_root,
    request_extra_keys,
    tokens_to_bytes,
)
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.ingest.ingestor import Ingestor
from kvindex.indexer.ingest.wire import decode_live
from tests.support.paths import FIXTURES

MODEL = "demo-model"
BLOCK = 16
TOKENS = [(7919 * i) % 150_000 for i in range(3 * BLOCK)]
VERSIONS = ["0.33.0", "0.23.0"]


# --- the key function -----------------------------------------------------------------


def test_pinned_values_of_the_key_scheme() -> None:
    # Keys are stored in Redis: changing any of these values needs a new KEY_SCHEME.
    assert KEY_SCHEME == "xxh3-64/v1"
    assert model_root(MODEL) == 15418148056895411826
    assert block_keys(MODEL, list(range(40)), BLOCK) == [
        8784210439067133460,
        18320252727831650172,
    ]
    salted_lora = block_keys(
        MODEL, list(range(32)), BLOCK, lora_name="sql-lora", cache_salt="tenant-a"
    )
    assert salted_lora == [6908415229276842164, 1084728854483508964]


def test_keys_are_deterministic() -> None:
    first = block_keys(MODEL, TOKENS, BLOCK)
    assert first == block_keys(MODEL, tuple(TOKENS), BLOCK)
    assert len(first) == 3
    assert len(set(first)) == 3
    assert all(0 <= key < 1 << 64 for key in first)


@pytest.mark.parametrize("block", [0, 1, 2])
@pytest.mark.parametrize("offset", [0, BLOCK - 1])
def test_keys_are_chained(block: int, offset: int) -> None:
    changed = list(TOKENS)
    changed[block * BLOCK + offset] += 1
    before, after = block_keys(MODEL, TOKENS, BLOCK), block_keys(MODEL, changed, BLOCK)
    assert after[:block] == before[:block]
    assert all(a != b for a, b in zip(after[block:], before[block:], strict=True))


def test_same_block_after_different_prefix_gets_different_key() -> None:
    swapped = TOKENS[BLOCK : 2 * BLOCK] + TOKENS[:BLOCK] + TOKENS[2 * BLOCK :]
    assert block_keys(MODEL, swapped, BLOCK)[2] != block_keys(MODEL, TOKENS, BLOCK)[2]


def test_keys_are_namespaced_by_model() -> None:
    one, other = block_keys(MODEL, TOKENS, BLOCK), block_keys("other-model", TOKENS, BLOCK)
    assert model_root(MODEL) != model_root("other-model")
    assert all(a != b for a, b in zip(one, other, strict=True))


def test_lora_name_changes_every_key() -> None:
    plain = block_keys(MODEL, TOKENS, BLOCK)
    lora = block_keys(MODEL, TOKENS, BLOCK, lora_name="sql-lora")
    other = block_keys(MODEL, TOKENS, BLOCK, lora_name="chat-lora")
    assert all(len({a, b, c}) == 3 for a, b, c in zip(plain, lora, other, strict=True))


def test_cache_salt_changes_keys_from_the_first_block() -> None:
    plain = block_keys(MODEL, TOKENS, BLOCK)
    salted = block_keys(MODEL, TOKENS, BLOCK, cache_salt="tenant-a")
    other = block_keys(MODEL, TOKENS, BLOCK, cache_salt="tenant-b")
    assert all(len({a, b, c}) == 3 for a, b, c in zip(plain, salted, other, strict=True))


def test_cache_salt_is_hashed_into_the_first_block_only() -> None:
    assert request_extra_keys(3, cache_salt="s") == [("s",), None, None]
    assert request_extra_keys(2, lora_name="l", cache_salt="s") == [("l", "s"), ("l",)]
    assert request_extra_keys(2, lora_name="l") == [("l",), ("l",)]
    assert request_extra_keys(2) is None
    root, data = model_root(MODEL), tokens_to_bytes(TOKENS)
    first = chain_keys(root, data[: BLOCK * 4], BLOCK, [("s",)])
    rest = chain_keys(first[0], data[BLOCK * 4 :], BLOCK)
    assert block_keys(MODEL, TOKENS, BLOCK, cache_salt="s") == first + rest


@pytest.mark.parametrize("extra", [None, (), []])
def test_empty_extra_keys_mean_none(extra: Any) -> None:
    data = tokens_to_bytes(TOKENS)
    with_empty = chain_keys(model_root(MODEL), data, BLOCK, [extra] * 3)
    assert with_empty == block_keys(MODEL, TOKENS, BLOCK)


def test_tuple_and_list_extra_keys_agree() -> None:
    # Decoded events carry msgpack arrays; requests build tuples. Both must hash alike.
    data = tokens_to_bytes(TOKENS[:BLOCK])
    as_list = chain_keys(0, data, BLOCK, [["sql-lora", ["9f" * 32, 3]]])
    assert as_list == chain_keys(0, data, BLOCK, [("sql-lora", ("9f" * 32, 3))])


def test_partial_trailing_block_is_ignored() -> None:
    full = block_keys(MODEL, TOKENS[: 2 * BLOCK], BLOCK)
    assert block_keys(MODEL, TOKENS[: 2 * BLOCK + BLOCK - 1], BLOCK) == full
    assert block_keys(MODEL, TOKENS[: BLOCK - 1], BLOCK) == []
    assert block_keys(MODEL, [], BLOCK) == []


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40, -(2**63)])
def test_token_ids_outside_u32_raise(bad: int) -> None:
    tokens = list(TOKENS[:BLOCK])
    tokens[5] = bad
    with pytest.raises(BlockKeyError):
        block_keys(MODEL, tokens, BLOCK)
    with pytest.raises(BlockKeyError):
        tokens_to_bytes(tokens)


def test_bad_token_id_in_a_tuple_raises_too() -> None:
    with pytest.raises(BlockKeyError):
        block_keys(MODEL, (*TOKENS[: BLOCK - 1], -1), BLOCK)


def test_token_ids_of_the_partial_trailing_block_are_not_checked() -> None:
    full = block_keys(MODEL, TOKENS[:BLOCK], BLOCK)
    assert block_keys(MODEL, [*TOKENS[:BLOCK], -1], BLOCK) == full


def _documented_keys(
    parent: int, tokens: list[int], block_size: int, extras: list[Any] | None
) -> list[int]:
    """The byte layout of the module docstring, spelled out one block at a time."""
    keys = []
    for i in range(len(tokens) // block_size):
        chunk = tokens[i * block_size : (i + 1) * block_size]
        data = parent.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in chunk)
        if extras is not None and extras[i] not in (None, (), []):
            data += msgspec.msgpack.encode(extras[i])
        parent = xxhash.xxh3_64_intdigest(data)
        keys.append(parent)
    return keys


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 2**64 - 1),
    st.lists(st.integers(0, 2**32 - 1), max_size=70),
    st.sampled_from([1, 2, 3, 16]),
    st.booleans(),
)
def test_chain_keys_follow_the_documented_byte_layout(
    parent: int, tokens: list[int], block_size: int, with_extras: bool
) -> None:
    num_blocks = len(tokens) // block_size
    extras: list[Any] | None = None
    if with_extras:
        extras = [None if i % 3 else ("lora", i) for i in range(num_blocks)]
    token_bytes = tokens_to_bytes(tokens)
    expected = _documented_keys(parent, tokens, block_size, extras)
    assert chain_keys(parent, token_bytes, block_size, extras) == expected


def test_many_block_sizes_keep_right_keys_and_a_bounded_layout_cache() -> None:
    tokens = list(range(70))
    for block_size in range(1, 71):  # more sizes than the cache keeps
        expected = _documented_keys(7, tokens, block_size, None)
        assert chain_keys(7, tokens_to_bytes(tokens), block_size) == expected
    assert len(keys_module._LAYOUTS) <= keys_module._MAX_LAYOUTS


def test_token_id_bounds_are_inclusive() -> None:
    tokens = [0] * (BLOCK - 1) + [2**32 - 1]
    assert len(block_keys(MODEL, tokens, BLOCK)) == 1
    assert tokens_to_bytes([1, 2**32 - 1]) == b"\x01\x00\x00\x00\xff\xff\xff\xff"


@pytest.mark.parametrize("size", [0, -1, -BLOCK])
def test_block_size_must_be_positive(size: int) -> None:
    with pytest.raises(BlockKeyError):
        block_keys(MODEL, TOKENS, size)
    with pytest.raises(BlockKeyError):
        chain_keys(0, tokens_to_bytes(TOKENS), size)


def test_fewer_extra_keys_than_blocks_raise() -> None:
    with pytest.raises(BlockKeyError):
        chain_keys(0, tokens_to_bytes(TOKENS), BLOCK, [None, ("s",)])


def test_unencodable_extra_keys_raise() -> None:
    with pytest.raises(BlockKeyError):
        chain_keys(0, tokens_to_bytes(TOKENS[:BLOCK]), BLOCK, [(object(),)])


# --- agreement with keys ingested from vLLM's own events --------------------------------


def _capture(version: str) -> dict[str, Any]:
    text = (FIXTURES / f"vllm-{version}-kv-events.json").read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def _frames(capture: dict[str, Any], vector_id: str) -> list[bytes]:
    (vector,) = [v for v in capture["vectors"] if v["id"] == vector_id]
    return [base64.b64decode(f) for f in vector["frames_b64"]]


def _event_int(digest_hex: str) -> int:
    """vLLM's int projection of a block digest: the last 8 bytes, big-endian."""
    return int.from_bytes(bytes.fromhex(digest_hex)[-8:], "big")


def _ingest(
    capture: dict[str, Any], vector_ids: list[str], *, fresh_ingestor: bool = False
) -> tuple[MemoryIndex, StreamId]:
    """Decode and apply captured batches in order, as the subscriber would."""
    index = MemoryIndex()
    ingestor = Ingestor(index)
    stream = StreamId("pod-a", 0)
    for vector_id in vector_ids:
        message = decode_live(_frames(capture, vector_id))
        model = Topic.parse(message.topic).model
        assert model == MODEL
        stream = StreamId("pod-a", message.batch.rank)
        if fresh_ingestor:  # parents must then come from the index, not the ingestor's cache
            ingestor = Ingestor(index)
        report = ingestor.apply(stream, model, message.batch)
        assert report.applied
        assert (report.num_orphan_stores, report.num_misaligned_events) == (0, 0)
        assert (report.num_bad_events, report.num_skipped_group_events) == (0, 0)
    return index, stream


def _flat(blocks: list[list[int]]) -> list[int]:
    return [token for block in blocks for token in block]


def _salt(hash_extra_keys: list[Any]) -> str:
    """The cache salt among a block's hashed extra keys: tagged (≥ 0.31) or bare."""
    for item in hash_extra_keys:
        if isinstance(item, list) and item[:1] == ["cache_salt"]:
            return str(item[1])
        if isinstance(item, str):
            return item
    raise AssertionError(f"no cache salt in {hash_extra_keys!r}")


CHAIN_BATCHES = [
    pytest.param(["pub-rank0-seq0", "pub-rank0-seq1"], id="rank0"),
    pytest.param(["pub-rank1-seq0", "pub-rank1-seq1", "pub-rank1-seq2"], id="rank1"),
]


@pytest.mark.parametrize("fresh_ingestor", [False, True], ids=["cached", "via-index"])
@pytest.mark.parametrize("vector_ids", CHAIN_BATCHES)
@pytest.mark.parametrize("version", VERSIONS)
def test_plain_chain_keys_agree_with_events(
    version: str, vector_ids: list[str], fresh_ingestor: bool
) -> None:
    capture = _capture(version)
    hashing = capture["meta"]["hashing"]
    assert hashing["block_size"] == BLOCK
    index, stream = _ingest(capture, vector_ids, fresh_ingestor=fresh_ingestor)
    stored = index.resolve(stream, hashing["chain_event_int"])
    expected = block_keys(MODEL, _flat(hashing["blocks_token_ids"]), BLOCK)
    assert len(expected) == 3
    assert stored == expected


@pytest.mark.parametrize("version", VERSIONS)
def test_salted_chain_keys_agree_with_events(version: str) -> None:
    capture = _capture(version)
    salted = capture["meta"]["hashing"]["salted_chain"]
    salt = _salt(salted["hash_extra_keys_block0"])
    assert salt == "tenant-a"
    index, stream = _ingest(capture, ["pub-rank0-seq0", "pub-rank0-seq1"])
    stored = index.resolve(stream, [_event_int(d) for d in salted["digest_hex"]])
    tokens = _flat(salted["token_ids"])
    expected = block_keys(MODEL, tokens, BLOCK, cache_salt=salt)
    assert len(expected) == 2
    assert stored == expected
    unsalted = block_keys(MODEL, tokens, BLOCK)
    assert all(s != u for s, u in zip(expected, unsalted, strict=True))


@pytest.mark.parametrize("version", VERSIONS)
def test_lora_multimodal_block_differs_from_lora_only_request(version: str) -> None:
    capture = _capture(version)
    block = capture["meta"]["hashing"]["lora_mm_block"]
    index, stream = _ingest(capture, ["pub-rank0-seq2"])
    (stored,) = index.resolve(stream, [_event_int(block["digest_hex"])])
    event = decode_live(_frames(capture, "pub-rank0-seq2")).batch.events[0]
    assert isinstance(event, BlockStored)
    assert event.lora_name == "sql-lora"
    assert event.extra_keys is not None
    tokens = block["token_ids"]
    lora_only = block_keys(MODEL, tokens, BLOCK, lora_name=event.lora_name)
    assert stored is not None
    assert stored != lora_only[0]
    assert stored != block_keys(MODEL, tokens, BLOCK)[0]
    # What makes the difference is the multimodal item in the event's extra keys.
    with_item = chain_keys(model_root(MODEL), tokens_to_bytes(tokens), BLOCK, event.extra_keys)
    assert [stored] == with_item
