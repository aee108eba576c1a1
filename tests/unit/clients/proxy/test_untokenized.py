"""kvindex.clients.proxy.untokenized: the header on an answer routed without tokens, and the
warning held to one a model per window."""

from __future__ import annotations

import asyncio
import logging

import pytest
from starlette.types import Message, Receive, Scope, Send

from kvindex.clients.proxy.untokenized import (
    TOKENIZER_HEADER,
    FailureLog,
    UntokenizedHeader,
    mark_untokenized,
)


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope.get("path") == "/failed":
        mark_untokenized()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"a", b"1")]})
    await send({"type": "http.response.body", "body": b"x"})


def _served(path: str, kind: str = "http") -> list[Message]:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def main() -> None:
        await UntokenizedHeader(_app)({"type": kind, "path": path}, receive, send)

    asyncio.run(main())
    return sent


def test_a_marked_request_gets_the_header_once() -> None:
    start, body = _served("/failed")
    assert start["headers"] == [(b"a", b"1"), (TOKENIZER_HEADER.encode(), b"failed")]
    assert body == {"type": "http.response.body", "body": b"x"}


def test_an_unmarked_request_passes_untouched() -> None:
    start, _ = _served("/ok")
    assert start["headers"] == [(b"a", b"1")]


def test_a_mark_outside_a_request_does_nothing() -> None:
    mark_untokenized()  # no wrapper: no note to write to


def test_each_request_starts_unmarked() -> None:
    """Requests served one after another in one context (as a kept-alive connection may)."""
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def main() -> None:
        wrapped = UntokenizedHeader(_app)
        await wrapped({"type": "http", "path": "/failed"}, receive, send)
        await wrapped({"type": "http", "path": "/ok"}, receive, send)

    asyncio.run(main())
    assert len(sent[0]["headers"]) == 2 and len(sent[2]["headers"]) == 1


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
