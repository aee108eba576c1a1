"""check-hash's comparison on hand-made events (no sockets, no HTTP)."""

from __future__ import annotations

import base64
import json
from dataclasses import replace

import msgspec
import pytest
from click.testing import CliRunner

from kvindex.clients.cli.key_check import (
    CheckHashError,
    CheckSettings,
    Expected,
    ObservedBatch,
    compare,
    is_complete,
)
from kvindex.clients.cli.main import main
from kvindex.clients.fake_vllm.block_pool import BlockPool
from kvindex.indexer.domain.events import BlockStored
from kvindex.indexer.ingest.wire import decode_payload, payload_producer, payload_shape
from tests.support.paths import FIXTURES

MODEL = "m"
SIZE = 4
TOKENS = tuple(range(100, 100 + 3 * SIZE + 2))  # 3 full blocks + 2 tokens


def stored(
    tokens: tuple[int, ...] = TOKENS,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    block_size: int = SIZE,
) -> list[BlockStored]:
    """What a vLLM-like block pool publishes for ``tokens`` (one event per admission)."""
    cache = BlockPool(64, block_size, root=12345)
    admission = cache.admit(0, tokens, len(tokens), lora_name=lora_name, cache_salt=cache_salt)
    assert admission is not None
    return [e for e in admission.events if isinstance(e, BlockStored)]


def batch(*events: BlockStored, seq: int = 0) -> ObservedBatch:
    return ObservedBatch(seq, events)


def expected(**changes: object) -> Expected:
    return replace(Expected(MODEL, TOKENS, SIZE), **changes)  # type: ignore[arg-type]


def split(event: BlockStored, at: int) -> tuple[BlockStored, BlockStored]:
    """The same blocks as two events (as vLLM does over scheduler steps)."""
    extras = event.extra_keys
    first = msgspec.structs.replace(
        event,
        block_hashes=event.block_hashes[:at],
        token_ids=event.token_ids[: at * SIZE],
        extra_keys=None if extras is None else extras[:at],
    )
    second = msgspec.structs.replace(
        event,
        block_hashes=event.block_hashes[at:],
        parent_hash=event.block_hashes[at - 1],
        token_ids=event.token_ids[at * SIZE :],
        extra_keys=None if extras is None else extras[at:],
    )
    return first, second


def test_agreeing_events_pass() -> None:
    report = compare(expected(), [batch(*stored())])
    assert report.ok, report.render()
    assert (report.num_blocks, report.block_size, report.hash_forms) == (3, SIZE, ["int"])
    assert report.render().startswith("check-hash OK: 3 blocks checked, block size 4")


def test_salt_and_lora_agree_and_events_split_over_batches_are_joined() -> None:
    [event] = stored(lora_name="a", cache_salt="s")
    first, second = split(event, 1)
    noise = stored(tuple(range(7, 30)))  # another request's blocks: ignored
    batches = [batch(second, seq=2), batch(*noise, seq=0), batch(first, seq=1)]
    report = compare(expected(lora_name="a", cache_salt="s"), batches)
    assert report.ok, report.render()
    assert report.num_blocks == 3


def test_block_size_mismatch_is_named_first() -> None:
    report = compare(expected(block_size=2), [batch(*stored())])
    assert report.mismatches[0].message == "block size: events use 4, kvindex expects 2"
    assert report.mismatches[-1].check == "keys"


def test_salt_missing_from_the_request_is_named() -> None:
    report = compare(expected(), [batch(*stored(cache_salt="tenant-a"))])
    checks = [m.check for m in report.mismatches]
    assert checks == ["extra_keys", "keys"]
    assert report.mismatches[0].message == (
        "extra keys differ on block 0: events ['tenant-a'], request []"
    )


def test_lora_name_only_in_pre_017_field_counts_on_every_block() -> None:
    [event] = stored(lora_name="a")
    legacy = msgspec.structs.replace(event, extra_keys=None)  # vLLM < 0.17: no extra_keys
    assert compare(expected(lora_name="a"), [batch(legacy)]).ok
    report = compare(expected(lora_name="b"), [batch(legacy)])
    assert report.mismatches[0].message == (
        "extra keys differ on block 0 (and 2 more blocks): events ['a'], request ['b']"
    )


def test_missing_blocks_and_broken_chain_are_named() -> None:
    [event] = stored()
    first, second = split(event, 2)
    report = compare(expected(), [batch(first)])
    assert report.mismatches[0].message == (
        "token ids: events cover 2 of the prompt's 3 full blocks (block 2 missing)"
    )
    assert not is_complete(expected(), [batch(first)])
    assert is_complete(expected(), [batch(first), batch(second)])
    broken = msgspec.structs.replace(second, parent_hash=999)
    report = compare(expected(), [batch(first), batch(broken)])
    assert [m.check for m in report.mismatches] == ["chain", "keys"]
    assert report.mismatches[0].message.startswith("chain: block 2's parent 0x3e7 is not block 1")
    rooted = msgspec.structs.replace(event, parent_hash=1)
    assert compare(expected(), [batch(rooted)]).mismatches[0].message == (
        "chain: block 0 has parent 0x1, expected null (the start of a sequence)"
    )


def test_wrong_tokens_inside_an_event_are_named() -> None:
    [event] = stored()
    tokens = list(event.token_ids)
    tokens[SIZE + 1] = 7
    bad = msgspec.structs.replace(event, token_ids=tuple(tokens))
    report = compare(expected(), [batch(bad)])
    assert report.mismatches[0].message == (
        "token ids differ on block 1: events [104, 7, 106, 107], prompt [104, 105, 106, 107]"
    )


def test_no_events_for_the_prompt() -> None:
    report = compare(expected(), [batch(*stored(tuple(range(7, 30))))])
    assert not report.ok
    assert report.mismatches[0].message == "no BlockStored events for the prompt"
    assert not is_complete(expected(), [])


def test_an_endpoint_without_a_scheme_is_named() -> None:
    with pytest.raises(CheckHashError, match="--events must be a ZeroMQ endpoint"):
        CheckSettings(url="http://127.0.0.1:9", events="127.0.0.1:5557", model="m")
    with pytest.raises(CheckHashError, match="--replay must be a ZeroMQ endpoint"):
        CheckSettings(url="http://h:1", events="tcp://h:1", model="m", replay="h:2")


@pytest.mark.parametrize(
    ("events", "named"),
    [
        ("127.0.0.1:5557", "--events must be a ZeroMQ endpoint (tcp://, ipc://), got '127.0"),
        ("tcp://no-port", "--events 'tcp://no-port': Invalid argument"),
    ],
)
def test_check_hash_with_a_bad_endpoint_says_so_in_one_line(events: str, named: str) -> None:
    args = ["check-hash", "--url", "http://127.0.0.1:9", "--events", events, "--model", "m"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [f"Error: {result.output.strip()[7:]}"]
    assert named in result.output
    assert "Traceback" not in result.output


def test_sglangs_captured_salted_stores_agree_and_name_sglang() -> None:
    """SGLang 0.5.23's own frames (the golden capture): the salted chain and its child
    page, read as check-hash reads live frames, agree with the request's keys."""
    capture = json.loads((FIXTURES / "sglang-0.5.23-kv-events.json").read_text())
    vectors = {v["id"]: v for v in capture["vectors"]}
    batches = []
    for name, at in (("pub-rank0-seq1", 1), ("pub-rank0-seq3", 1)):
        payload = base64.b64decode(vectors[name]["frames_b64"][2])
        decoded = decode_payload(payload, vectors[name]["seq"])
        salted = decoded.events[at]
        assert isinstance(salted, BlockStored)
        encoding, form = payload_shape(payload)
        producer = payload_producer(payload)
        batches.append(ObservedBatch(decoded.seq, (salted,), encoding, form, "live", producer))
    tokens = tuple(t for b in batches for t in b.events[0].token_ids)
    page = capture["meta"]["page_size"]
    report = compare(Expected(MODEL, tokens, page, cache_salt="tenant-a"), batches)
    assert report.ok, report.render()
    assert (report.num_blocks, report.producers) == (3, ["SGLang"])
    assert ", producer SGLang (live events;" in report.render()
    assert not compare(Expected(MODEL, tokens, page), batches).ok  # the salt is checked
