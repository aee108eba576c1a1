"""kvindex.api.load.model: a Load is always valid; the newer-or-same store rule."""

from __future__ import annotations

import math

import msgspec
import pytest

from kvindex.api.load.model import MAX_FUTURE_S, Load, LoadError, is_newer_or_same
from kvindex.indexer.domain.errors import KvIndexError
from tests.unit.api.load.samples import a_load


def test_load_error_is_a_kvindex_error() -> None:
    assert issubclass(LoadError, KvIndexError)


@pytest.mark.parametrize("usage", [0.0, 1.0])
def test_usage_bounds_are_inclusive(usage: float) -> None:
    assert a_load(kv_usage=usage).kv_usage == usage


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("running", -1.0),
        ("waiting", -0.5),
        ("ts", -1.0),
        ("kv_usage", -0.01),
        ("kv_usage", 1.01),
        ("running", math.nan),
        ("waiting", math.inf),
        ("kv_usage", math.nan),
        ("ts", math.inf),
        ("running", "3"),
        ("waiting", True),
    ],
)
def test_invalid_values_are_rejected_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(LoadError, match=rf"^{field} must be"):
        a_load(**{field: value})


def test_a_ts_too_far_ahead_of_now_is_rejected_naming_ts() -> None:
    now = 1_700_000_000.0
    assert a_load(ts=now + MAX_FUTURE_S).validated(now=now).ts == now + MAX_FUTURE_S
    with pytest.raises(LoadError, match=r"^ts must be at most 60 s ahead of now"):
        a_load(ts=1e12).validated(now=now)


def test_validated_returns_the_load_itself() -> None:
    load = a_load()
    assert load.validated() is load


def test_unknown_source_is_rejected() -> None:
    with pytest.raises(LoadError, match="source must be one of"):
        a_load(source="guess")


def test_decoding_checks_too() -> None:
    raw = b'{"running":1,"waiting":0,"kv_usage":1.5,"ts":1.0,"source":"push"}'
    with pytest.raises(LoadError, match="kv_usage"):
        msgspec.json.decode(raw, type=Load)


def test_load_is_frozen() -> None:
    with pytest.raises(AttributeError):
        a_load().running = 2.0  # type: ignore[misc]


def test_age() -> None:
    assert a_load(ts=100.0).age_s(now=112.5) == 12.5
    assert a_load(ts=100.0).age_s(now=90.0) == 0.0


def test_newer_or_same_rule() -> None:
    assert is_newer_or_same(a_load(ts=1.0), None)
    assert is_newer_or_same(a_load(ts=2.0), a_load(ts=1.0))
    assert is_newer_or_same(a_load(ts=1.0), a_load(ts=1.0))
    assert not is_newer_or_same(a_load(ts=1.0), a_load(ts=2.0))
