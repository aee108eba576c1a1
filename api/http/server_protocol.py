"""Reference: kvindex.api.http.app._score_routes; tests/integration/test_server_protocol.py::test_hot_answers_equal_the_apps

:class:`HotProtocol`: uvicorn's protocol answering a plain ``POST /score`` or ``GET
/healthz`` in the parser's callbacks (one write), with the app's answer function, error
mapping, traffic metrics and body timeout; anything else (HTTP/1.0, ``Connection: close``,
a chunked body, ``x-forwarded-for``, a bad token, ...) is left to the app.
"""  # noqa: E501

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, cast

from starlette.datastructures import Headers
from starlette.types import Scope
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from kvindex.api.http.body_limit import body_timeout_error
from kvindex.api.http.hot_routes import MAPPED_ERRORS, HotRoute, HotServing
from kvindex.api.http.request_head import HeadDeadlineProtocol

log = logging.getLogger("kvindex.api")
_SERVER_ERROR = (
    b"content-type: text/plain; charset=utf-8\r\ncontent-length: 21\r\nconnection: close\r\n"
    b"\r\nInternal Server Error"
)
"""What uvicorn sends when the app raised before answering."""
_LEFT_TO_APP = frozenset((b"transfer-encoding", b"x-forwarded-for"))
"""Headers that send a hot request to the app: a chunked body (the body limit counts it as
it comes), a forwarded client address (the app's proxy-headers rewrite applies)."""


class _NoEvent:
    """uvicorn sets its cycle's body event when the connection is lost; a hot request has
    none."""

    def set(self) -> None:
        pass


_NO_EVENT = _NoEvent()


@dataclass(slots=True)
class _HotCycle:
    """A hot request as uvicorn's connection bookkeeping sees it (its ``cycle``): the
    attributes it reads and sets (shutdown, connection loss, pipelining)."""

    route: HotRoute
    headers: Headers
    started: float
    chunks: list[bytes] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    response_complete: bool = False
    disconnected: bool = False
    keep_alive: bool = True
    message_event: _NoEvent = _NO_EVENT


class HotProtocol(HeadDeadlineProtocol):
    """uvicorn's httptools protocol with the request-head deadline; the plain requests of
    :attr:`hot`'s routes answered in its callbacks (the module docstring says which)."""

    hot: HotServing | None = None
    """Set per server by :func:`hot_protocol` (None: every request goes to the app)."""
    _pending: _HotCycle | None = None
    """The hot request whose body is being read."""
    _idle_since: float | None = None
    """Loop time of the last answer with no request begun since (None: one is in hand)."""
    _idle_timer: asyncio.TimerHandle | None = None
    """The connection's one keep-alive timer (:meth:`on_response_complete`)."""
    _head_of: list[tuple[bytes, bytes]] | None = None
    _head: bytes = b""
    """The server's default headers (``_head_of``) as they are written."""

    def data_received(self, data: bytes) -> None:
        self._idle_since = None
        super().data_received(data)
        cycle = self._pending
        if cycle is not None and cycle.timer is None and cycle.route.reads_body:
            # The body did not come whole with its head: it must now come in time (armed
            # here, once the bytes read are parsed, so that a whole request costs no timer).
            timeout_s = self._serving().body_timeout_s
            cycle.timer = self.loop.call_later(timeout_s, self._body_too_late, cycle)

    def on_message_begin(self) -> None:
        # Not idle from here (a request pipelined behind an answer comes with no new read).
        self._idle_since = None
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        cycle = self._hot_cycle()
        if cycle is None:
            super().on_headers_complete()
            return
        self.cycle = cycle  # type: ignore[assignment]  # uvicorn reads the few fields it has
        self._pending = cycle

    def on_body(self, body: bytes) -> None:
        if self._pending is None:
            super().on_body(body)
        else:
            self._pending.chunks.append(body)

    def on_message_complete(self) -> None:
        cycle = self._pending
        if cycle is None:
            super().on_message_complete()
            return
        self._pending = None
        if cycle.timer is not None:
            cycle.timer.cancel()
        chunks = cycle.chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        _run_eagerly(self._respond(cycle, body), self.loop, self.tasks)

    def connection_lost(self, exc: Exception | None) -> None:
        cycle, self._pending = self._pending, None
        if cycle is not None:  # the client left before its body was whole
            if cycle.timer is not None:
                cycle.timer.cancel()
            cycle.response_complete = True
            self._observe(cycle, 500)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        """uvicorn's, but with one keep-alive timer per connection, not one per answer: an
        answer notes the time; the timer, armed when none is, closes the connection when it
        fires ``timeout_keep_alive`` after the last answer with no request begun since, and
        else is armed again for when that will be (none while a request is in hand: the next
        answer arms it)."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = now = self.loop.time()
        if self._idle_timer is None:
            self._idle_timer = self.loop.call_at(now + self.timeout_keep_alive, self._idle_due)

    def _idle_due(self) -> None:
        self._idle_timer = None
        since = self._idle_since
        if since is None:
            return
        due = since + self.timeout_keep_alive
        if self.loop.time() < due:
            self._idle_timer = self.loop.call_at(due, self._idle_due)
        else:
            self.timeout_keep_alive_handler()

    def _serving(self) -> HotServing:
        assert self.hot is not None  # only called for a hot request
        return self.hot

    def _hot_cycle(self) -> _HotCycle | None:
        """The hot request whose head just completed, or None: the app answers it."""
        hot = self.hot
        if hot is None:
            return None
        route = hot.routes.get((self.parser.get_method(), self.url))
        if route is None or not self._plain():
            return None
        if not _body_fits(route, self.headers, hot.max_body_bytes):
            return None
        headers = Headers(raw=self.headers)
        if route.guarded:
            try:
                hot.authorize(headers)
            except MAPPED_ERRORS:  # the app answers it (401), as it would have
                return None
        self.scope["method"] = route.method
        self.scope["path"] = route.path
        self.scope["route"] = route.route  # type: ignore[typeddict-unknown-key]
        return _HotCycle(route, headers, time.perf_counter())

    def _plain(self) -> bool:
        """A keep-alive HTTP/1.1 request, nothing asked beyond an answer, none before it
        still unanswered."""
        parser, cycle = self.parser, self.cycle
        return (
            parser.get_http_version() == "1.1"
            and parser.should_keep_alive()
            and not parser.should_upgrade()
            and not self.expect_100_continue
            and self.limit_concurrency is None
            and (cycle is None or cycle.response_complete)
        )

    async def _respond(self, cycle: _HotCycle, body: bytes) -> None:
        """Answer ``cycle`` (``body``: its whole body) and finish it."""
        try:
            payload = await cycle.route.answer(body, cycle.headers)
        except MAPPED_ERRORS as exc:
            self._send_error(cycle, exc)
        except Exception:  # not the app's to map: logged, 500 (as uvicorn answers it)
            log.exception("answering %s %s failed", cycle.route.method, cycle.route.path)
            self._finish(cycle, 500, STATUS_LINE[500] + self._default_head() + _SERVER_ERROR)
        else:
            head = b"content-length: %d\r\ncontent-type: application/json\r\n\r\n" % len(payload)
            parts = (STATUS_LINE[200], self._default_head(), head, payload)
            self._finish(cycle, 200, b"".join(parts))  # the payload copied once

    def _send_error(self, cycle: _HotCycle, exc: Exception) -> None:
        """The app's answer to ``exc`` (its one error mapping)."""
        response = self._serving().error_response(exc)
        lines = [STATUS_LINE[response.status_code], self._default_head()]
        for name, value in response.raw_headers:
            if name == b"connection" and value == b"close":
                cycle.keep_alive = False
            lines += (name, b": ", value, b"\r\n")
        lines += (b"\r\n", bytes(response.body))
        self._finish(cycle, response.status_code, b"".join(lines))

    def _default_head(self) -> bytes:
        """The headers uvicorn puts on every answer (``date``, ``server``): written out once
        per list (the server makes a new one when the date changes, once a second)."""
        headers = self.server_state.default_headers
        if headers is not self._head_of:
            self._head = b"".join(b"%s: %s\r\n" % pair for pair in headers)
            self._head_of = headers
        return self._head

    def _finish(self, cycle: _HotCycle, status: int, response: bytes) -> None:
        """Write ``response`` (one write), count it, and go on as uvicorn does after an answer
        (the keep-alive timer, the next pipelined request) or close."""
        cycle.response_complete = True
        self._observe(cycle, status)
        if cycle.disconnected or self.transport.is_closing():
            return
        self.transport.write(response)
        if status == 500 or not cycle.keep_alive:
            self.transport.close()
            return
        self.on_response_complete()

    def _observe(self, cycle: _HotCycle, status: int) -> None:
        self._serving().observe(
            cast(Scope, self.scope), status, time.perf_counter() - cycle.started
        )

    def _body_too_late(self, cycle: _HotCycle) -> None:
        """The body did not arrive whole in time: the app's 408, and the connection closed."""
        if self._pending is not cycle:
            return
        self._pending = None
        cycle.timer = None
        cycle.keep_alive = False
        self._send_error(cycle, body_timeout_error(self._serving().body_timeout_s))


def _body_fits(route: HotRoute, raw: list[tuple[bytes, bytes]], max_bytes: int) -> bool:
    """The body is declared by one length, within ``max_bytes`` (none on a route that reads
    none), and no header asks for what the app does beyond the answer (``raw``: the
    request's headers as uvicorn keeps them, names lowercased; one pass over them)."""
    declared: bytes | None = None
    for name, value in raw:
        if name == b"content-length":
            if declared is not None:
                return False
            declared = value
        elif name in _LEFT_TO_APP:
            return False
    if declared is None:
        return not route.reads_body
    if not declared.isdigit():
        return False
    return int(declared) <= max_bytes if route.reads_body else int(declared) == 0


def _run_eagerly(
    coro: Coroutine[Any, Any, None], loop: asyncio.AbstractEventLoop, tasks: set[Any]
) -> None:
    """Run ``coro`` now, in this callback; if it waits, the rest in a task (kept in ``tasks``,
    the server's, which shutdown waits for), as an eager task would."""
    try:
        awaited = coro.send(None)
    except StopIteration:
        return
    task = loop.create_task(_resume(coro, awaited))
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def _resume(coro: Coroutine[Any, Any, None], awaited: Any) -> None:
    """Drive ``coro`` on from the point where it yielded ``awaited`` (what a task does: wait
    for the future it yielded, or a loop turn for a bare yield, then send it on; a
    cancellation is thrown into it)."""
    while True:
        cancelled: asyncio.CancelledError | None = None
        try:
            if awaited is None:
                await asyncio.sleep(0)
            else:
                # The flag ``coro``'s await set, which a task resets on taking the future.
                awaited._asyncio_future_blocking = False
                await awaited
        except asyncio.CancelledError as exc:
            cancelled = exc
        except Exception:  # the future's own error: ``coro`` reads it from the future
            pass
        try:
            awaited = coro.send(None) if cancelled is None else coro.throw(cancelled)
        except StopIteration:
            return


def hot_protocol(timeout_s: float, hot: HotServing | None) -> type[HotProtocol]:
    """A protocol class whose request heads must arrive within ``timeout_s`` and which
    answers ``hot``'s plain requests itself (None: none)."""
    return type("HotHeadDeadline", (HotProtocol,), {"timeout_s": timeout_s, "hot": hot})
