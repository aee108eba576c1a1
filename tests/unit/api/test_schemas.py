"""kvindex.api.schemas.decode_score_request: the packed read of ``token_ids`` changes nothing.

A body whose token ids the compiled reader takes gives the request a full decode gives (its
``token_ids`` None, the ids as u32 bytes instead); any other body is decoded in full, so a
bad one fails with the error the full decode raises. Random bodies (hypothesis) judge it:
token arrays in any JSON spelling (spaces, bounds, out-of-range, fractions, signs, leading
zeros), other fields beside them, another "token_ids" array before the body's own (nested,
in a string, a duplicate key, an escaped key name), the splice marker in the body, bodies
cut short or trailed by junk, and bodies also sent to the scorer both ways.
"""

from __future__ import annotations

import asyncio
import struct
from unittest.mock import patch

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.api import schemas
from kvindex.api.config.settings import ApiSettings
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.schemas import (
    MAX_TOKEN_IDS,
    ScoreRequest,
    ScoreResponse,
    decode_score_request,
)
from kvindex.api.score import Scorer
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.domain.keys import block_keys
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.index.protocol import OpKind


def _full(body: bytes) -> ScoreRequest | str:
    try:
        return msgspec.json.decode(body, type=ScoreRequest)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _read(body: bytes) -> tuple[ScoreRequest | str, bytes | None]:
    try:
        return decode_score_request(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return f"{type(exc).__name__}: {exc}", None


def _as_full(request: ScoreRequest | str, packed: bytes | None) -> ScoreRequest | str:
    """The request a full decode would give: the packed ids back as a list."""
    if packed is None or isinstance(request, str):
        return request
    assert request.token_ids is None
    ids = list(struct.unpack(f"<{len(packed) // 4}I", packed))
    return msgspec.structs.replace(request, token_ids=ids)


_SPACE = st.sampled_from(["", " ", "\n", "\t ", "\r\n"])
_ID = st.integers(0, 2**32 - 1).map(str) | st.sampled_from(
    ["4294967296", "-1", "1.0", "1e3", "01", "00", "", "true", "null", '"7"', "[1]", "99999999999"]
)


@st.composite
def _token_array(draw: st.DrawFn) -> str:
    ids = draw(st.lists(_ID, max_size=12))
    items = [f"{draw(_SPACE)}{i}{draw(_SPACE)}" for i in ids]
    return draw(st.sampled_from(["[", " ["])) + ",".join(items) + draw(_SPACE) + "]"


_OTHER = st.sampled_from(
    [
        "",
        ', "top_k": 3',
        ', "top_k": -1',
        ', "prompt": "x"',
        ', "lora_name": "a", "cache_salt": "s"',
        ', "unknown": 1',
        ', "candidates": ["r0"], "dry_run": true',
    ]
)


_LAYOUT = st.sampled_from(
    [
        '{{"model": "m", "token_ids": {tokens}{other}}}',
        '{{"token_ids" :{tokens}, "model": "m"{other}}}  ',
        # another "token_ids" before the object's own, or the own one spelt otherwise:
        '{{"model": "m", "messages": [{{"token_ids": [5]}}], "token_ids": {tokens}{other}}}',
        '{{"model": "m", "messages": [{{"token_ids": {tokens}}}]{other}}}',
        r'{{"model": "m", "prompt": "\"token_ids\": [1]", "token_ids": {tokens}{other}}}',
        r'{{"model": "m", "token\u005fids": {tokens}{other}}}',
        '{{"model": "m", "token_ids": [7], "token_ids": {tokens}{other}}}',
        '{{"model": "m", "user": "kvindex:token_ids", "token_ids": {tokens}{other}}}',
        # the array nested, the own field the spliced-in marker's very text:
        '{{"model": "m", "messages": [{{"token_ids": {tokens}}}], '
        '"token_ids": "kvindex:token_ids"}}',
        '{{"model": "m", "token_ids": {tokens}{other}',
        '{{"model": "m", "token_ids": {tokens}{other}}} x',
    ]
)


@settings(max_examples=600)
@given(
    _token_array() | st.sampled_from(["null", "[]", "[,]", "[1,]", "[1 2]", "{}", '"1"']),
    _OTHER,
    _LAYOUT,
)
def test_the_packed_read_gives_what_the_full_decode_gives(
    tokens: str, other: str, layout: str
) -> None:
    body = layout.format(tokens=tokens, other=other).encode()
    request, packed = _read(body)
    assert _as_full(request, packed) == _full(body)


def test_a_nested_token_array_is_not_taken_for_the_request_s() -> None:
    body = b'{"model": "m", "messages": [{"token_ids": [5]}], "token_ids": [1, 2]}'
    request, packed = decode_score_request(body)
    assert packed == struct.pack("<2I", 1, 2)
    assert request.messages == [{"token_ids": [5]}]
    assert decode_score_request(b'{"model": "m", "messages": [{"token_ids": [5]}]}')[1] is None


def test_without_the_compiled_reader_every_body_decodes_in_full() -> None:
    body = b'{"model": "m", "token_ids": [1, 2]}'
    with (
        patch.object(schemas, "_json_token_ids", None),
        patch.object(schemas, "_json_token_span", None),
    ):
        assert decode_score_request(body) == (ScoreRequest(model="m", token_ids=[1, 2]), None)


def test_plain_token_arrays_are_read_packed() -> None:
    request, packed = decode_score_request(b'{"model": "m", "token_ids": [ 1, 2,4294967295 ]}')
    assert request == ScoreRequest(model="m")
    assert packed == struct.pack("<3I", 1, 2, 2**32 - 1)
    assert decode_score_request(b'{"model": "m", "token_ids": []}')[1] == b""


def test_bodies_without_token_ids_and_too_many_ids_decode_in_full() -> None:
    assert decode_score_request(b'{"model": "m", "block_keys": [1]}')[1] is None
    too_many = msgspec.json.encode({"model": "m", "token_ids": [0] * (MAX_TOKEN_IDS + 1)})
    with pytest.raises(msgspec.ValidationError, match="length <= 1048576"):
        decode_score_request(too_many)


def _scorer() -> Scorer:
    """Two replicas, one holding the prompt's first two blocks (with a LoRA, one other)."""
    specs = (ReplicaSpec("a", "m"), ReplicaSpec("b", "m"))
    registry = Registry(specs)
    index = MemoryIndex()
    for replica, lora in (("a", None), ("b", "x")):
        keys = block_keys("m", list(range(64)), 16, lora_name=lora)[:2]
        ops = [(OpKind.STORE, Tier.GPU, i, key) for i, key in enumerate(keys)]
        index.apply(StreamId(replica), 0, 0.0, ops)
        registry.record(StreamId(replica), StreamReport(last_seq=0, block_size=16))
    return Scorer(
        ApiSettings(), index, registry, MemoryLoadStore(), tokenizers=lambda _: None,
        blocking_store=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    "extra", ["", ', "lora_name": "x"', ', "cache_salt": "s"', ', "prompt": "p"']
)
def test_the_scorer_answers_packed_ids_as_it_answers_the_list(extra: str) -> None:
    body = f'{{"model": "m", "token_ids": {list(range(70))}, "dry_run": true{extra}}}'.encode()
    request, packed = decode_score_request(body)
    assert packed is not None

    async def both() -> tuple[object, object]:
        scorer = _scorer()
        listed = await _answer(scorer, msgspec.json.decode(body, type=ScoreRequest), None)
        return listed, await _answer(scorer, request, packed)

    listed, read = asyncio.run(both())
    assert read == listed
    if "prompt" not in extra:  # answered (not the 422 of two inputs), the blocks matched
        assert isinstance(read, ScoreResponse)
        assert (read.num_matched, read.num_blocks) == (0 if "salt" in extra else 1, 4)


async def _answer(scorer: Scorer, request: ScoreRequest, packed: bytes | None) -> object:
    try:
        answer = await scorer.score(request, packed_tokens=packed)
    except Exception as exc:  # the same error, whichever way the ids came
        return f"{type(exc).__name__}: {exc}"
    return msgspec.structs.replace(answer, scores=[s.replica for s in answer.scores])


@pytest.mark.parametrize("generation_prompt", [None, True])
def test_a_chat_continued_with_a_generation_prompt_is_refused_naming_both(
    generation_prompt: bool | None,
) -> None:
    fields = {} if generation_prompt is None else {"add_generation_prompt": generation_prompt}
    body = {"model": "m", "messages": [], "continue_final_message": True, **fields}
    with pytest.raises(msgspec.ValidationError, match="add_generation_prompt defaults to true"):
        decode_score_request(msgspec.json.encode(body))
    body["add_generation_prompt"] = False
    request, _ = decode_score_request(msgspec.json.encode(body))
    assert request.continue_final_message and not request.add_generation_prompt
