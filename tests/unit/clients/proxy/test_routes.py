"""Paths in normal form: no spelling of ``..`` leaves ``/v1/``."""

from __future__ import annotations

import pytest

from kvindex.clients.proxy.routes import escapes, is_plain_route, normal_path

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


def test_a_plain_route_may_be_outside_v1_but_not_the_proxys_own() -> None:
    for route in ("/tokenize", "/detokenize", "/v1/load_lora_adapter"):
        assert is_plain_route(route), route
    for route in ("/metrics", "/v1/models", "/v1/models/x", "/health", "/v1/completions"):
        assert not is_plain_route(route), route
    for route in ("tokenize", "/a/", "/a//b", "/a/../b", "/a%2e", "/"):
        assert not is_plain_route(route), route
