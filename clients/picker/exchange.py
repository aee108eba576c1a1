"""One ext_proc stream, one HTTP request: the body buffered to its end (at most
``max_body_bytes``), then the choice named on the headers' answer when the gateway waits for
it, else on the last body chunk's; in full-duplex mode every body byte is sent back. The
reservation is released at the response's end of stream, or by the servicer."""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, ClassVar

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

from kvindex.clients.picker import messages
from kvindex.clients.picker.admission import Admission, Ticket
from kvindex.clients.picker.decision import Decision, RefusalError
from kvindex.clients.picker.endpoints import SERVED_KEY, served_in, subset_of
from kvindex.clients.picker.messages import Response
from kvindex.clients.picker.metrics import PickerMetrics

logger = logging.getLogger("kvindex.picker")
_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_STREAMED = processing_mode_pb2.ProcessingMode.STREAMED
_NO_BODY = processing_mode_pb2.ProcessingMode.NONE

Choose = Callable[[bytes, Mapping[str, str], frozenset[str] | None], Awaitable[Decision]]
"""An OpenAI body, the request's headers and the subset hint → the decision (or a RefusalError)."""


class Phase(enum.Enum):
    HEADERS = "request headers awaited"
    BODY = "request body"
    SENT = "upstream (response awaited)"
    RESPONSE = "response"
    DONE = "done"


class Exchange:
    """Fed each ProcessingRequest by :meth:`handle`, which returns the answers to send now;
    :attr:`finished` once the stream owes nothing more (an ImmediateResponse ends it)."""

    def __init__(
        self,
        choose: Choose,
        admission: Admission,
        metrics: PickerMetrics,
        *,
        max_body_bytes: int,
        on_answered: Callable[[str], None] = lambda _replica: None,
    ) -> None:
        """``on_answered``: told the replica that answered (a response status under 500)."""
        self._choose = choose
        self._on_answered = on_answered
        self._admission = admission
        self._metrics = metrics
        self._max_body_bytes = max_body_bytes
        self.phase = Phase.HEADERS
        self.finished = False
        self.ticket: Ticket | None = None
        self.served: str | None = None
        self._decision: Decision | None = None
        self._owed: Callable[[], Coroutine[Any, Any, bytes]] | None = None
        self._headers: dict[str, str] = {}
        self._subset: frozenset[str] | None = None
        self._chunks: list[bytes] = []
        self._num_bytes = 0
        self._num_held = 0  # body chunks not answered yet (streamed mode, headers waiting)
        self._request_mode = _FULL_DUPLEX
        self._response_mode = _FULL_DUPLEX
        self._headers_wait = True
        self._body_seen = False

    async def handle(self, request: Any) -> list[Response]:
        kind = request.WhichOneof("request")
        if request.HasField("protocol_config"):
            self._configure(request.protocol_config)
        if self.finished:  # the stream owes nothing more (the servicer ends it)
            return []
        handler = self._HANDLERS.get(kind or "")
        if handler is None:
            return self._refuse(RefusalError(400, "bad_request", f"unexpected message {kind!r}"))
        try:
            return await handler(self, request)
        except RefusalError as refusal:
            return self._refuse(refusal)
        except Exception as exc:  # a store or tokenizer failure: the gateway answers 500
            logger.exception("picking failed")
            return self._refuse(RefusalError(500, "error", f"the picker failed: {exc}"))

    def _configure(self, config: Any) -> None:
        self._request_mode = config.request_body_mode
        self._response_mode = config.response_body_mode
        self._headers_wait = self._request_mode == _FULL_DUPLEX or (
            self._request_mode == _STREAMED and config.send_body_without_waiting_for_header_response
        )

    async def _request_headers(self, request: Any) -> list[Response]:
        self._expect(Phase.HEADERS, "request headers")
        headers = request.request_headers
        self._headers = _header_map(headers.headers.headers)
        self._subset = subset_of(request.metadata_context)
        if headers.end_of_stream:  # no body (a GET): chosen on load alone
            return await self._decide(in_body=False)
        self.phase = Phase.BODY
        return [] if self._headers_wait else [messages.request_headers_continue()]

    async def _request_body(self, request: Any) -> list[Response]:
        self._expect(Phase.BODY, "a request body chunk")
        chunk = request.request_body
        self._num_bytes += len(chunk.body)
        if self._num_bytes > self._max_body_bytes:
            raise RefusalError(
                413,
                "too_large",
                f"request body over {self._max_body_bytes} bytes (api.max_body_bytes)",
            )
        self._chunks.append(chunk.body)
        self._body_seen = True
        if chunk.end_of_stream:
            return await self._decide(in_body=not self._headers_wait)
        if self._request_mode == _FULL_DUPLEX:
            return []
        if self._headers_wait:
            self._num_held += 1
            return []
        return [messages.body_continue(response=False)]

    async def _request_trailers(self, _request: Any) -> list[Response]:
        if self.phase is Phase.BODY:  # trailers end the body
            answers = await self._decide(in_body=not self._headers_wait, end=False)
            if self.finished:
                return answers
            if not self._headers_wait:  # all but the trailers answered: the metadata names it
                return [messages.trailers_continue(response=False, like=answers[0])]
            return [*answers, messages.trailers_continue(response=False)]
        self._expect(Phase.SENT, "request trailers")
        return [messages.trailers_continue(response=False)]

    async def _response_headers(self, request: Any) -> list[Response]:
        if self.phase is not Phase.SENT:
            self._expect(Phase.SENT, "response headers")
        self.phase = Phase.RESPONSE
        headers = request.response_headers
        found = _header_map(headers.headers.headers)
        self.served = served_in(request.metadata_context) or found.get(SERVED_KEY)
        self._answered(found.get(":status", ""))
        answers = [messages.response_headers_continue()]
        if headers.end_of_stream or self._response_mode == _NO_BODY:
            await self._end()
        return answers

    async def _response_body(self, request: Any) -> list[Response]:
        self._expect(Phase.RESPONSE, "a response body chunk")
        chunk = request.response_body
        if self._response_mode == _FULL_DUPLEX:
            answer = messages.body_streamed(chunk.body, chunk.end_of_stream, response=True)
        else:
            answer = messages.body_continue(response=True)
        if chunk.end_of_stream:
            await self._end()
        return [answer]

    async def _response_trailers(self, _request: Any) -> list[Response]:
        self._expect(Phase.RESPONSE, "response trailers")
        await self._end()
        return [messages.trailers_continue(response=True)]

    _HANDLERS: ClassVar[dict[str, Callable[[Exchange, Any], Awaitable[list[Response]]]]] = {
        "request_headers": _request_headers,
        "request_body": _request_body,
        "request_trailers": _request_trailers,
        "response_headers": _response_headers,
        "response_body": _response_body,
        "response_trailers": _response_trailers,
    }

    def _expect(self, phase: Phase, what: str) -> None:
        if self.phase is not phase:
            raise RefusalError(400, "bad_request", f"{what} during {self.phase.value}")

    async def _decide(self, *, in_body: bool, end: bool = True) -> list[Response]:
        started = time.perf_counter()
        if self._admission.full():
            raise RefusalError(429, "shed", "the picker is at its requests in flight limit")
        body = b"".join(self._chunks)
        self._chunks = []
        decision = await self._choose(body, self._headers, self._subset)
        self.ticket = await self._admission.admit(
            decision.replicas[0], decision.num_uncached_tokens
        )
        self._decision = decision
        self._owed = decision.rest
        if decision.rest is not None:
            self._metrics.head_decisions.inc()
        self.phase = Phase.SENT
        answers = self._answers(decision, body, in_body=in_body, end=end)
        self._metrics.child(self._metrics.decisions, "routed").inc()
        self._metrics.decision_latency.observe(time.perf_counter() - started)
        return answers

    def _answers(
        self, decision: Decision, body: bytes, *, in_body: bool, end: bool
    ) -> list[Response]:
        named = messages.destination(decision.endpoints, len(body), in_body=in_body)
        if in_body or not self._body_seen:  # the last chunk's answer, or no body at all
            return [named]
        answers = [named]
        if self._request_mode == _FULL_DUPLEX:
            answers.append(messages.body_streamed(body, end, response=False))
        else:  # each held chunk passed on as it came
            answers += [messages.body_continue(response=False)] * (self._num_held + int(end))
        self._num_held = 0
        return answers

    def _answered(self, status: str) -> None:
        """Tell ``on_answered`` of the replica that served, when its status says it is up."""
        decision = self._decision
        if decision is None or not (status.isascii() and status.isdigit()) or int(status) >= 500:
            return
        endpoints, served = decision.endpoints, self.served
        at = endpoints.index(served) if served in endpoints else 0
        self._on_answered(decision.replicas[at])

    async def settle(self) -> None:
        """What is owed once the answers are sent: a head's prompt tokenized whole (kept for
        its next turn, its reservation recounted); a failure is logged and counted."""
        rest, self._owed = self._owed, None
        if rest is None:
            return
        try:
            packed = await rest()
        except Exception:  # the tokenizer's own failure: the decision stands
            self._metrics.head_rest_failures.inc()
            logger.exception("tokenizing the rest of a prompt decided on its head failed")
            return
        ticket = self.ticket  # no replica held any of it: every token is uncached
        if ticket is not None and not ticket.released:
            await self._admission.recount(ticket, len(packed) // 4)

    async def _end(self) -> None:
        """The response ended: the request no longer counts as in flight."""
        self.phase = Phase.DONE
        self.finished = True
        ticket, served = self.ticket, self.served
        if ticket is None:
            return
        decision = self._decision
        if served and decision is not None and served != decision.endpoints[0]:
            self._metrics.served_elsewhere.inc()
            if served in decision.endpoints:
                ticket = self.ticket = await self._admission.move(
                    ticket, decision.replicas[decision.endpoints.index(served)]
                )
        await self._admission.release(ticket, "done")

    def _refuse(self, refusal: RefusalError) -> list[Response]:
        self.finished = True
        self.phase = Phase.DONE
        self._metrics.child(self._metrics.decisions, refusal.outcome).inc()
        if refusal.outcome == "subset_miss":
            self._metrics.subset_misses.inc()
        return [messages.immediate(refusal.status, str(refusal))]


def _header_map(headers: Any) -> dict[str, str]:
    """Header name (lower case) → value (``raw_value`` as Envoy sends it, else ``value``)."""
    found: dict[str, str] = {}
    for header in headers:
        raw = header.raw_value
        found[header.key.lower()] = raw.decode("utf-8", "replace") if raw else header.value
    return found
