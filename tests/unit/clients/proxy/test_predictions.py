"""The prediction rule, the usage readers and the body that asks for a stream's usage."""

from __future__ import annotations

import msgspec
import pytest

from kvindex.clients.proxy.predictions import (
    MAX_BODY_BYTES,
    BodyTruth,
    Prediction,
    Predictions,
    StreamTruth,
    Truth,
    outcome_of,
    truth_of,
    with_usage_asked,
)


def _prediction(num_tokens: int = 100, matched: int = 64, block_size: int = 16) -> Prediction:
    return Prediction("r1", "m", num_tokens, matched, block_size)


@pytest.mark.parametrize(
    ("prediction", "truth", "outcome", "error"),
    [
        (_prediction(), Truth(100, 64), "exact", 0),
        (_prediction(), Truth(100, 48), "over_predicted", 16),
        (_prediction(), Truth(100, 80), "under_predicted", -16),
        (_prediction(), Truth(101, 64), "token_mismatch", None),
        (_prediction(), None, "unreported", None),
        # 64 tokens, 4 blocks held: the engine never caches the last token, so 3 blocks.
        (_prediction(64, 64), Truth(64, 48), "exact", 0),
        (_prediction(64, 64), Truth(64, 64), "under_predicted", -16),
        (_prediction(1, 0), Truth(1, 0), "exact", 0),
    ],
)
def test_outcome_rule(
    prediction: Prediction, truth: Truth | None, outcome: str, error: int | None
) -> None:
    assert outcome_of(prediction, truth) == (outcome, error)


def test_truth_of_reads_usage_and_nothing_else() -> None:
    body = {"id": "x", "choices": [{"text": "a" * 10}], "usage": {"prompt_tokens": 7,
            "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}}  # fmt: skip
    assert truth_of(msgspec.json.encode(body)) == Truth(7, 0)
    assert truth_of(b'{"usage": {"prompt_tokens": 7}}') is None  # no details: unreported
    assert truth_of(b'{"usage": {"prompt_tokens": 7, "prompt_tokens_details": null}}') is None
    assert truth_of(b'{"usage": null}') is None
    assert truth_of(b"not json") is None
    assert truth_of(b'{"usage": {"prompt_tokens": "x"}}') is None


def _events(*datas: object) -> bytes:
    out = b"".join(b"data: " + msgspec.json.encode(d) + b"\n\n" for d in datas)
    return out + b"data: [DONE]\n\n"


_USAGE = {
    "choices": [],
    "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}},
}
_CHUNK = {"choices": [{"index": 0, "text": " usage"}]}


@pytest.mark.parametrize("hide", [True, False])
@pytest.mark.parametrize("piece", [1, 7, 64, 10_000])
def test_stream_truth_reads_and_hides_the_usage_chunk_however_split(hide: bool, piece: int) -> None:
    whole = _events(_CHUNK, _CHUNK, _USAGE)
    reader = StreamTruth(hide=hide)
    out = b"".join(reader.feed(whole[i : i + piece]) for i in range(0, len(whole), piece))
    out += reader.end()
    assert reader.truth == Truth(9, 8)
    assert out == (_events(_CHUNK, _CHUNK) if hide else whole)


def test_stream_truth_passes_a_stream_without_usage_unchanged() -> None:
    whole = _events(_CHUNK, _CHUNK)
    reader = StreamTruth(hide=True)
    assert reader.feed(whole) == whole and reader.end() == b"" and reader.truth is None


def test_body_truth_is_bounded() -> None:
    reader = BodyTruth()
    body = msgspec.json.encode({"choices": [], **_USAGE})
    for i in range(0, len(body), 5):
        reader.feed(body[i : i + 5])
    assert reader.truth == Truth(9, 8)
    big = BodyTruth()
    big.feed(b" " * MAX_BODY_BYTES)
    big.feed(body)
    assert big.truth is None


def test_with_usage_asked() -> None:
    body = b' {"model": "m", "stream": true}'
    asked = with_usage_asked(body, msgspec.json.decode(body))
    assert asked is not None
    assert msgspec.json.decode(asked) == {
        "model": "m", "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    empty = with_usage_asked(b"{}", {})
    assert empty is not None
    assert msgspec.json.decode(empty) == {"stream_options": {"include_usage": True}}
    already = {"stream_options": {"include_usage": True}}
    assert with_usage_asked(msgspec.json.encode(already), already) is None
    other = {"stream": True, "stream_options": {"continuous_usage_stats": False}}
    asked = with_usage_asked(msgspec.json.encode(other), other)
    assert asked is not None
    assert msgspec.json.decode(asked)["stream_options"] == {
        "continuous_usage_stats": False, "include_usage": True}  # fmt: skip
    null = {"stream": True, "stream_options": None}
    asked = with_usage_asked(msgspec.json.encode(null), null)
    assert asked is not None
    assert msgspec.json.decode(asked)["stream_options"] == {"include_usage": True}


def test_predictions_count_per_replica() -> None:
    seen: list[str] = []
    predictions = Predictions(lambda _p, outcome, _e: seen.append(outcome))
    predictions.record(_prediction(), Truth(100, 64))
    predictions.record(_prediction(), Truth(100, 48))
    predictions.record(_prediction(), None)
    view = predictions.accuracy()["r1"].view()
    assert view["accuracy"] == 0.5 and view["exact"] == 1 and view["unreported"] == 1
    assert seen == ["exact", "over_predicted", "unreported"]
