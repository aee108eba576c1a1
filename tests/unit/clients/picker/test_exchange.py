"""The exchange's answers to each message sequence a gateway sends, in each body mode, on a
chooser stand-in and the real admission over an in-memory ledger."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvindex.api.load.desk import ReservationDesk
from kvindex.api.load.reservations import MemoryLedger, Reservations
from kvindex.api.tokenize.protocol import TokenizerError, pack_ids
from kvindex.clients.picker.admission import Admission
from kvindex.clients.picker.decision import Decision, RefusalError
from kvindex.clients.picker.exchange import Exchange
from kvindex.clients.picker.metrics import PickerMetrics
from tests.support.gateway import (
    BUFFERED,
    FULL_DUPLEX,
    STREAMED,
    Picked,
    body_messages,
    headers_message,
    response_body_message,
    response_headers_message,
)

BODY = b'{"model": "m", "prompt": "a b c d"}'
DECISION = Decision(("10.0.0.1:8000", "10.0.0.2:8000"), ("r1", "r2"), 4)


class Fleet:
    def __init__(self, *, max_in_flight: int = 8, fail: Exception | None = None) -> None:
        self.ledger = MemoryLedger()
        self.metrics = PickerMetrics()
        desk = ReservationDesk(Reservations(self.ledger, 10.0), self.metrics.desk_series())
        self.admission = Admission(desk, max_in_flight=max_in_flight)
        self.fail = fail
        self.seen: list[tuple[bytes, frozenset[str] | None]] = []

    async def choose(
        self, body: bytes, _headers: Mapping[str, str], subset: frozenset[str] | None
    ) -> Decision:
        self.seen.append((body, subset))
        if self.fail is not None:
            raise self.fail
        return DECISION

    def exchange(self, max_body_bytes: int = 1024) -> Exchange:
        return Exchange(self.choose, self.admission, self.metrics, max_body_bytes=max_body_bytes)

    def in_flight(self) -> dict[str, int]:
        return {r: f.num_requests for r, f in self.ledger.totals().items()}


def _run(exchange: Exchange, *messages: Any) -> list[Any]:
    async def feed() -> list[Any]:
        answers: list[Any] = []
        for message in messages:
            answers += await exchange.handle(message)
        return answers

    return asyncio.run(feed())


def _kinds(answers: list[Any]) -> list[str]:
    return [a.WhichOneof("response") for a in answers]


def _head(mode: int, no_wait: bool = False) -> Any:
    return headers_message({":method": "POST"}, mode=mode, no_wait=no_wait)


def test_full_duplex_names_the_choice_then_sends_the_body_back_whole() -> None:
    fleet = Fleet()
    exchange = fleet.exchange()
    request = _run(exchange, _head(FULL_DUPLEX), *body_messages(BODY, 3))
    assert _kinds(request) == ["request_headers", "request_body"]
    picked = Picked(request)
    assert picked.header == picked.metadata == "10.0.0.1:8000,10.0.0.2:8000"
    assert picked.body_sent_back() == BODY and fleet.seen == [(BODY, None)]
    assert fleet.in_flight() == {"r1": 1}
    response = _run(
        exchange,
        response_headers_message(),
        response_body_message(b"x", False),
        response_body_message(b"y", True),
    )
    assert _kinds(response) == ["response_headers", "response_body", "response_body"]
    echoed = [a.response_body.response.body_mutation.streamed_response for a in response[1:]]
    assert [(e.body, e.end_of_stream) for e in echoed] == [(b"x", False), (b"y", True)]
    assert fleet.in_flight() == {} and exchange.finished


def test_streamed_without_waiting_answers_headers_then_each_chunk_unchanged() -> None:
    fleet = Fleet()
    answers = _run(fleet.exchange(), _head(STREAMED, no_wait=True), *body_messages(BODY, 3))
    assert _kinds(answers) == ["request_headers"] + 3 * ["request_body"]
    assert Picked(answers).header == "10.0.0.1:8000,10.0.0.2:8000"
    assert all(a == pb.ProcessingResponse(request_body=pb.BodyResponse()) for a in answers[1:])


@pytest.mark.parametrize("mode", [STREAMED, BUFFERED])
def test_a_gateway_waiting_for_the_headers_answer_gets_the_choice_on_the_last_chunk(
    mode: int,
) -> None:
    fleet = Fleet()
    answers = _run(fleet.exchange(), _head(mode), *body_messages(BODY, 2))
    assert _kinds(answers) == ["request_headers", "request_body", "request_body"]
    assert not answers[0].request_headers.HasField("response")  # continued, nothing named
    picked = Picked(answers[2:])
    assert picked.header == picked.metadata == "10.0.0.1:8000,10.0.0.2:8000"


def test_trailers_end_the_body() -> None:
    fleet = Fleet()
    chunk = pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY))
    trailers = pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
    answers = _run(fleet.exchange(), _head(FULL_DUPLEX), chunk, trailers)
    assert _kinds(answers) == ["request_headers", "request_body", "request_trailers"]
    streamed = answers[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == BODY and not streamed.end_of_stream


def test_trailers_after_a_waiting_gateways_body_carry_the_metadata() -> None:
    fleet = Fleet()
    chunk = pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY))
    trailers = pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
    answers = _run(fleet.exchange(), _head(STREAMED), chunk, trailers)
    assert _kinds(answers) == ["request_headers", "request_body", "request_trailers"]
    assert Picked(answers).metadata == "10.0.0.1:8000,10.0.0.2:8000"


def test_no_response_body_to_wait_for_ends_at_the_response_headers() -> None:
    fleet = Fleet()
    exchange = fleet.exchange()
    head = headers_message({":method": "POST"}, mode=STREAMED, no_wait=True)
    head.protocol_config.response_body_mode = 0  # NONE: no response body message will come
    _run(exchange, head, *body_messages(BODY, 1))
    assert fleet.in_flight() == {"r1": 1}
    _run(exchange, response_headers_message())
    assert fleet.in_flight() == {} and exchange.finished


def _status(answers: list[Any]) -> int:
    (answer,) = answers
    return int(answer.immediate_response.status.code)


def test_shed_past_the_in_flight_limit_then_admitted_again() -> None:
    fleet = Fleet(max_in_flight=1)
    first = fleet.exchange()
    _run(first, _head(FULL_DUPLEX), *body_messages(BODY, 1))
    second = fleet.exchange()
    assert _status(_run(second, _head(FULL_DUPLEX), *body_messages(BODY, 1))) == 429
    assert second.finished and second.ticket is None
    _run(first, response_headers_message(), response_body_message(b"", True))
    assert Picked(_run(fleet.exchange(), _head(FULL_DUPLEX), *body_messages(BODY, 1))).header


@pytest.mark.parametrize(
    ("fail", "status"),
    [(RefusalError(503, "no_endpoint", "none"), 503), (RuntimeError("store down"), 500)],
)
def test_a_refusal_or_a_failure_is_the_gateways_own_answer(fail: Exception, status: int) -> None:
    fleet = Fleet(fail=fail)
    assert _status(_run(fleet.exchange(), _head(FULL_DUPLEX), *body_messages(BODY, 2))) == status
    assert fleet.in_flight() == {}


def test_a_body_past_the_bound_is_413_before_the_end() -> None:
    fleet = Fleet()
    answers = _run(fleet.exchange(max_body_bytes=10), _head(FULL_DUPLEX), *body_messages(BODY, 4))
    assert _status(answers) == 413 and fleet.seen == []


def test_messages_out_of_order_are_400() -> None:
    fleet = Fleet()
    assert _status(_run(fleet.exchange(), *body_messages(BODY, 1))) == 400
    assert _status(_run(fleet.exchange(), response_body_message(b"", True))) == 400
    twice = _run(fleet.exchange(), _head(FULL_DUPLEX), _head(FULL_DUPLEX))
    assert _status(twice) == 400
    assert _status(_run(fleet.exchange(), pb.ProcessingRequest())) == 400


def test_a_reported_fallback_carries_the_reservation_until_the_end() -> None:
    fleet = Fleet()
    exchange = fleet.exchange()
    _run(exchange, _head(FULL_DUPLEX), *body_messages(BODY, 1))
    _run(exchange, response_headers_message(served="10.0.0.2:8000"))
    assert exchange.served == "10.0.0.2:8000"
    _run(exchange, response_body_message(b"", True))
    assert fleet.in_flight() == {}
    assert fleet.metrics.served_elsewhere._value.get() == 1.0


@pytest.mark.parametrize("fails", [False, True])
def test_a_choice_made_on_a_head_owes_its_rest_until_settled(
    fails: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The rest runs once, when the servicer settles after the answers are written; a rest
    that fails is logged and counted, and the stream goes on to its end."""
    calls: list[int] = []

    async def rest() -> bytes:
        calls.append(1)
        if fails:
            raise TokenizerError("the tokenizer broke")
        return pack_ids(list(range(7)))

    fleet = Fleet()

    async def on_head(body: bytes, headers: Mapping[str, str], subset: Any) -> Decision:
        return dataclasses.replace(await fleet.choose(body, headers, subset), rest=rest)

    exchange = Exchange(on_head, fleet.admission, fleet.metrics, max_body_bytes=1024)
    _run(exchange, _head(FULL_DUPLEX), *body_messages(BODY, 2))
    assert calls == []
    with caplog.at_level(logging.ERROR):
        asyncio.run(exchange.settle())
        asyncio.run(exchange.settle())
    assert calls == [1]
    assert fleet.metrics.head_decisions._value.get() == 1
    assert fleet.metrics.head_rest_failures._value.get() == int(fails)
    assert ("the tokenizer broke" in caplog.text) == fails
    assert fleet.ledger.totals()["r1"].num_tokens == (4 if fails else 7)  # recounted
    _run(exchange, response_headers_message(), response_body_message(b"{}", True))
    assert exchange.finished and fleet.in_flight() == {}


@pytest.mark.parametrize(
    ("status", "served", "answered"),
    [
        (200, None, ["r1"]),
        (429, "10.0.0.2:8000", ["r2"]),
        (200, "10.9.9.9:1", ["r1"]),  # an endpoint it did not name: the primary's
        (503, None, []),
        (504, "10.0.0.2:8000", []),
        ("", None, []),  # garbage in the gateway's :status: no outcome either way
        ("2OO", None, []),
        ("²00", None, []),  # a digit to str.isdigit, not to int()
        ("-1", None, []),
    ],
)
def test_a_response_under_500_tells_which_replica_answered(
    status: int | str, served: str | None, answered: list[str]
) -> None:
    fleet = Fleet()
    told: list[str] = []
    exchange = Exchange(
        fleet.choose, fleet.admission, fleet.metrics, max_body_bytes=1024, on_answered=told.append
    )
    _run(exchange, _head(FULL_DUPLEX), *body_messages(BODY, 1))
    kinds = _kinds(_run(exchange, response_headers_message(status, served=served)))
    assert told == answered
    assert kinds == ["response_headers"]  # the replica's answer goes on, whatever its status
