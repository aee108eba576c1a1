"""The inbound bearer token: asked on every route but the probes, only when configured."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from kvindex.clients.proxy.auth import InboundAuth, UnauthorizedError


def test_the_token_is_asked_everywhere_but_the_probes_when_set() -> None:
    auth = InboundAuth("s3cret")
    auth.check("/v1/chat/completions", {"authorization": "Bearer s3cret"})
    for path in ("/health", "/healthz", "/readyz"):
        auth.check(path, {})
    for headers in ({}, {"authorization": "Bearer other"}, {"authorization": "s3cret"}):
        with pytest.raises(UnauthorizedError) as refused:
            auth.check("/v1/embeddings", headers)
        assert "s3cret" not in str(refused.value)
    with pytest.raises(UnauthorizedError):
        auth.check("/metrics", {"authorization": "Bearer s3crét"})  # a near miss
    InboundAuth(None).check("/v1/completions", {})  # no token configured: open


def test_every_spelling_of_a_guarded_path_is_guarded() -> None:
    auth = InboundAuth("s3cret")
    for path in ("/metrics/", "//metrics", "/./metrics", "/x/../metrics", "/v1/models/", "/"):
        with pytest.raises(UnauthorizedError):
            auth.check(path, {})
    for path in ("/health/", "//healthz", "/./readyz"):
        auth.check(path, {})  # a probe's path however spelled


def test_credentials_are_read_as_rfc_9110_defines_them() -> None:
    auth = InboundAuth("s3cret")
    for good in ("Bearer s3cret", "bearer s3cret", "BEARER   s3cret", " Bearer s3cret "):
        auth.check("/metrics", {"authorization": good})
    for bad in ("Bearer s3cret x", "Bearer\ts3cret", "Basic s3cret", "Bearer", "Bearer s3cre"):
        with pytest.raises(UnauthorizedError):
            auth.check("/metrics", {"authorization": bad})


def test_two_authorization_headers_are_refused() -> None:
    auth = InboundAuth("s3cret")
    raw = [(b"authorization", b"Bearer s3cret"), (b"authorization", b"Bearer s3cret")]
    with pytest.raises(UnauthorizedError):
        auth.check("/metrics", Headers(raw=raw))
    auth.check("/metrics", Headers(raw=raw[:1]))
