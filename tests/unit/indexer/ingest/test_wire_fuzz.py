"""The write path under fuzzed input (short run; ``bench/fuzz.py --cases N`` is the long
one): live frames (connect mode and the bound SUB) and replay replies, valid and corrupt in
every way ``tests/support/frame_fuzz.py`` knows, through the socket-free pipeline. Nothing raises,
every bad frame and event is counted, and the index is what the valid frames alone make."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings

from kvindex.indexer.domain.events import BlockStored, EventBatch, Tier
from kvindex.indexer.ingest.wire import WireError, decode_payload, to_wire
from tests.support.frame_fuzz import (
    Message,
    Reply,
    check_bound,
    check_live,
    check_replay,
    messages,
    replies,
)

FAST = settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FAST
@given(batch=messages())
def test_live_frames_apply_exactly_the_valid_ones_and_count_the_rest(
    batch: list[Message],
) -> None:
    check_live(batch)


@FAST
@given(batch=messages())
def test_the_bound_sub_registers_from_valid_frames_only_and_counts_the_rest(
    batch: list[Message],
) -> None:
    check_bound(batch)


@FAST
@given(found=replies())
def test_replay_replies_apply_exactly_the_valid_ones_and_count_the_rest(
    found: list[Reply],
) -> None:
    check_replay(found)


# Found by this fuzzer: an event nested deeper than msgspec recurses made the batch itself
# undecodable (RecursionError while reading the events raw), losing its valid events.
_DEEP_LIST = b"\x91" * 20_000 + b"\xc0"
_DEEP_MAP = b"\x81\xa1k" * 20_000 + b"\xc0"


@pytest.mark.parametrize("deep", [_DEEP_LIST, _DEEP_MAP], ids=["list", "map"])
def test_an_event_nested_past_the_decoders_depth_costs_only_itself(deep: bytes) -> None:
    stored = BlockStored((1,), None, [1, 2, 3, 4], 4, Tier.GPU)
    events = [to_wire(stored, "map"), msgspec.Raw(deep), to_wire(stored, "array")]
    payload = msgspec.msgpack.encode([0.0, events, 3])
    assert decode_payload(payload, 1) == EventBatch(1, 0.0, 3, (stored, stored), 1)


@pytest.mark.parametrize(
    "fields",
    [
        [msgspec.Raw(_DEEP_LIST), [], 0],
        [0.0, msgspec.Raw(_DEEP_MAP), 0],
        [0.0, [], msgspec.Raw(_DEEP_LIST)],
        [0.0, [msgspec.Raw(_DEEP_LIST)], 0, 1],
    ],
    ids=["ts", "events", "rank", "four fields"],
)
def test_a_batch_nested_past_the_decoders_depth_is_undecodable(fields: list[object]) -> None:
    payload = msgspec.msgpack.encode(fields)
    for broken in (payload, payload[:-1], payload + b"\x00"):
        with pytest.raises(WireError) as raised:
            decode_payload(broken, 7)
        assert raised.value.seq == 7


def test_a_deep_payload_too_large_to_walk_is_undecodable() -> None:
    events = [msgspec.Raw(_DEEP_LIST), "x" * (1 << 20)]
    with pytest.raises(WireError):
        decode_payload(msgspec.msgpack.encode([0.0, events, 0]), 1)
