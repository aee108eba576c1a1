"""Paths in normal form: no spelling of ``..`` leaves ``/v1/``."""

from __future__ import annotations

import pytest

from kvindex.clients.proxy.routes import escapes, normal_path

CASES = [
    ("/v1/chat/completions", "/v1/chat/completions"),
    ("/v1/./chat//completions", "/v1/chat/completions"),
    ("//v1///models", "/v1/models"),
    ("/v1/../tokenize", "/tokenize"),
    ("/v1/./../tokenize", "/tokenize"),
    ("/v1//..//tokenize", "/tokenize"),
    ("/v1\\..\\tokenize", "/tokenize"),
    ("/v1/a/b/../../../../../x", "/x"),
    ("/v1/a/..", "/v1/"),
    ("/v1/..", "/"),
    ("/", "/"),
    ("/v1/.hidden/..x", "/v1/.hidden/..x"),
]


@pytest.mark.parametrize(("sent", "normal"), CASES)
def test_normal_form(sent: str, normal: str) -> None:
    assert normal_path(sent) == normal
    assert normal_path(normal) == normal  # idempotent


def test_a_v1_path_normalised_out_of_v1_escapes() -> None:
    assert escapes("/v1/../kvsim/cached", "/kvsim/cached")
    assert escapes("/v1\\..\\tokenize", "/tokenize")
    assert not escapes("/v1/./models", "/v1/models")
    assert not escapes("/x/../v1/models", "/v1/models")
    assert not escapes("/metrics", "/metrics")
