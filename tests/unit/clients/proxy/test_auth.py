"""The inbound bearer token: asked on every route but the probes, only when configured."""

from __future__ import annotations

import pytest

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
