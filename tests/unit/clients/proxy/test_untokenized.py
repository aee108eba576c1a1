"""kvindex.clients.proxy.untokenized: the warning held to one a model per window (the header
is held by tests/integration/test_proxy_render.py and test_forwarding's extra headers)."""

from __future__ import annotations

import logging

import pytest

from kvindex.clients.proxy.untokenized import FailureLog


def test_failure_log_holds_back_repeats_per_model(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = FailureLog(logging.getLogger("kvindex.proxy.test"), window_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "kvindex.proxy.test"):
        log.failed("m", "replica r1: http://r1/tokenize: timed out")
        log.failed("m", "replica r1: other")
        log.failed("n", "replica r2: down")
        now[0] = 9.9
        log.failed("m", "held")
        now[0] = 10.0
        log.failed("m", "replica r1: back")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "tokenizer of m failed; routed on load alone: replica r1: http://r1/tokenize: timed out",
        "tokenizer of n failed; routed on load alone: replica r2: down",
        "tokenizer of m failed; routed on load alone: replica r1: back [2 more since]",
    ]
