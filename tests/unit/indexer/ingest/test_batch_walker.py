"""The batch walker against msgspec, its reference: the same batch, or the same refusal."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.indexer.ingest.batch_walker import walk_batch
from kvindex.indexer.ingest.wire import decode_raw_batch

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=300)
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=30,
)
_BATCHES = st.tuples(
    st.floats(allow_nan=False) | st.integers(-(2**63), 2**64 - 1) | _VALUES,
    st.lists(_VALUES, max_size=20) | _VALUES,
    st.none() | st.integers(-(2**63), 2**64 - 1) | _VALUES,
).map(list) | st.lists(_VALUES, max_size=4)


def _refused(read: object, payload: bytes) -> bool:
    try:
        read(payload)  # type: ignore[operator]
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, IndexError):
        return True
    return False


@settings(max_examples=200, deadline=None)
@given(_BATCHES, st.sampled_from(["whole", "truncated", "trailing"]))
def test_the_walker_reads_what_msgspec_reads(fields: list[object], cut: str) -> None:
    payload = msgspec.msgpack.encode(fields)
    if cut == "truncated":
        payload = payload[:-1]
    elif cut == "trailing":
        payload += b"\xc0"
    if _refused(decode_raw_batch, payload):
        assert _refused(walk_batch, payload)
        return
    batch = decode_raw_batch(payload)
    ts, events, rank = walk_batch(payload)
    assert (ts, rank) == (batch.ts, batch.data_parallel_rank)
    assert [bytes(e) for e in events] == [bytes(e) for e in batch.events]


@pytest.mark.parametrize("payload", [b"\xc1", b"\x93\x00\x91\xc1\x00", b"\x92\x00"])
def test_invalid_msgpack_is_refused(payload: bytes) -> None:
    assert _refused(walk_batch, payload) and _refused(decode_raw_batch, payload)
