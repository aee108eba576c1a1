"""Reference: kvindex.api.http.app._score_routes; tests/integration/test_server_protocol.py::test_hot_answers_equal_the_apps

uvicorn's protocol answering a plain keep-alive ``POST /score`` or ``GET /healthz`` in its
parser callbacks with the app's answer function and error mapping; the app answers the rest.
"""  # noqa: E501

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

from starlette.datastructures import Headers
from starlette.types import Scope
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from kvindex.api.http.body_limit import body_timeout_error
from kvindex.api.http.hot_routes import MAPPED_ERRORS, HotRoute, HotServing
from kvindex.api.http.lingering import LingeringProtocol

log = logging.getLogger("kvindex.api")
ABORT = "kvindex.abort"
"""A scope extension: a callable ending the answer under way with the connection, its body
unfinished (a proxy's replica broke off); the app then returns with nothing logged."""
ON_GONE = "kvindex.on_gone"
"""A scope extension: ``on_gone(callback)`` has ``callback()`` called once if the client's
connection is lost before the answer is complete; it returns the call that forgets it
(a client watched without a task reading ``receive``)."""
_SERVER_ERROR = (
    b"content-type: text/plain; charset=utf-8\r\ncontent-length: 21\r\nconnection: close\r\n"
    b"\r\nInternal Server Error"
)
_LEFT_TO_APP = frozenset((b"transfer-encoding", b"x-forwarded-for"))
"""Headers that leave a request to the app (its body limit, its proxy-headers rewrite)."""
_BARE_GET = re.compile(
    rb"GET (/[!-~]*) HTTP/1\.1\r\n"
    rb"(?:(?!(?i:content-length|transfer-encoding|connection|upgrade|expect|x-forwarded-for):)"
    rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t\x20-\x7e]*\r\n)*\r\n"
)
"""A whole plain ``GET`` head, each header a plain token and text: none that asks for
anything (a body, a close, an upgrade, a ``100 Continue``) or that leaves it to the app."""
_POSTED_HEAD = re.compile(
    rb"POST (/[!-~]*) HTTP/1\.1\r\n"
    rb"((?:(?!(?i:transfer-encoding|connection|upgrade|expect|x-forwarded-for):)"
    rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t\x20-\x7e]*\r\n)*)"
)
"""A whole plain ``POST`` head but its last CRLF, each header a plain token and text: none that
asks for anything (a close, an upgrade, a ``100 Continue``, a chunked body) or that leaves
the request to the app."""
_Posted = tuple[HotRoute, list[tuple[bytes, bytes]], int]
_POSTED_HEAD_BYTES = 8192
"""The longest head looked for (a longer one is the parser's)."""
_NO_HEADERS = Headers(raw=[])
_KEPT_HEADS, _KEPT_HEAD_BYTES = 256, 512
"""The most bare heads kept as matched, and the longest (128 kB at most in all)."""


class _NoEvent:
    """The body event uvicorn sets on connection loss; a hot request has none."""

    def set(self) -> None:
        pass


_NO_EVENT = _NoEvent()


@dataclass(slots=True)
class _HotCycle:
    """A hot request as uvicorn's connection bookkeeping sees it (its ``cycle``)."""

    route: HotRoute
    headers: Headers
    started: float
    chunks: list[bytes] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    response_complete: bool = False
    disconnected: bool = False
    keep_alive: bool = True
    message_event: _NoEvent = _NO_EVENT


class HotProtocol(LingeringProtocol):
    hot: HotServing | None = None
    _pending: _HotCycle | None = None
    _idle_since: float | None = None
    """Loop time of the last answer with no request begun since (None: one is in hand)."""
    _idle_timer: asyncio.TimerHandle | None = None
    _head_of: list[tuple[bytes, bytes]] | None = None
    _head: bytes = b""
    _gone_calls: list[Callable[[], None]] | None = None
    """What :data:`ON_GONE` asked to call when the request under way loses its client."""
    _bare_scopes: dict[str, Any] | None = None
    _constant_head: bytes | None = None
    _constant_payload: bytes | None = None
    _constant = b""

    def data_received(self, data: bytes) -> None:
        self._idle_since = None
        if self._answered_bare(data) or self._answered_posted(data):
            return
        super().data_received(data)
        cycle = self._pending
        if cycle is not None and cycle.timer is None and cycle.route.reads_body:
            # The body did not come whole with its head: it must now come in time (armed
            # here, once the bytes read are parsed, so that a whole request costs no timer).
            timeout_s = self._serving().body_timeout_s
            cycle.timer = self.loop.call_later(timeout_s, self._body_too_late, cycle)

    def _answered_bare(self, data: bytes) -> bool:
        """Reference: the parser's path (``on_headers_complete``'s hot cycle); tests/integration/test_server_protocol.py::test_bare_gets_are_answered_as_the_parser_answers_them

        ``data`` a whole plain ``GET`` of a bare route and nothing else, between requests:
        answered here, without the parser's callbacks; False: ``data`` is the parser's."""  # noqa: E501
        hot = self.hot
        if hot is None or not hot.bare or not self._between_requests():
            return False
        if not data.startswith(b"GET "):  # a body's bytes are never hashed below
            return False
        route = _bare_route(hot, data)
        if route is None or self.transport.is_closing():
            return False
        self._disarm()
        scope = self._bare_scopes.get(route.path) if self._bare_scopes is not None else None
        if scope is None:
            scope = self._bare_scope(route)
        self.scope = scope
        if route.constant is not None:  # as ``_respond`` answers it, with no coroutine
            started = time.perf_counter()
            self.transport.write(self._constant_answer(route.constant))
            self.on_response_complete()
            self._serving().observe(scope, 200, time.perf_counter() - started)
            return True
        answering = _HotCycle(route, _NO_HEADERS, time.perf_counter())
        self.cycle = answering  # type: ignore[assignment]  # uvicorn reads the few fields it has
        _run_eagerly(self._respond(answering, b""), self.loop, self.tasks)
        return True

    def _answered_posted(self, data: bytes) -> bool:
        """Reference: the parser's path (``on_headers_complete``'s hot cycle); tests/integration/test_server_protocol.py::test_plain_posts_are_answered_as_the_parser_answers_them

        ``data`` one whole plain ``POST`` of a hot route that reads a body, its body exactly
        what its one ``content-length`` declares, between requests: answered here, without
        the parser's callbacks; False: ``data`` is the parser's."""  # noqa: E501
        hot = self.hot
        if hot is None or not data.startswith(b"POST "):
            return False
        end = data.find(b"\r\n\r\n", 0, _POSTED_HEAD_BYTES)
        posted = _posted(hot, data[: end + 2]) if end > 0 else None
        if posted is None or len(data) - end - 4 != posted[2] or not self._between_requests():
            return False
        route, raw, _length = posted
        headers = Headers(raw=raw)
        if route.guarded:
            try:
                hot.authorize(headers)
            except MAPPED_ERRORS:  # the app answers it (401), as it would have
                return False
        if self.transport.is_closing():
            return False
        self._disarm()
        scope: dict[str, Any] = {"type": "http", "http_version": "1.1", "method": route.method}
        scope |= {"path": route.path, "route": route.route, "headers": raw}
        scope |= {"server": self.server, "client": self.client, "scheme": self.scheme}
        self.scope = scope  # type: ignore[assignment]  # what the count and the log read
        answering = _HotCycle(route, headers, time.perf_counter())
        self.cycle = answering  # type: ignore[assignment]  # uvicorn reads the few fields it has
        _run_eagerly(self._respond(answering, data[end + 4 :]), self.loop, self.tasks)
        return True

    def _between_requests(self) -> bool:
        """No request begun or unanswered, none queued, the connection plain and reading."""
        if self._in_message or self._unupgraded is not None:
            return False
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            return False
        return not (self.pipeline or self.lingering or self.limit_concurrency is not None)

    def _constant_answer(self, payload: bytes) -> bytes:
        """``_respond``'s 200 of ``payload``, made again when the default head changes."""
        head = self._default_head()
        if head is not self._constant_head or payload is not self._constant_payload:
            length = b"content-length: %d\r\ncontent-type: application/json\r\n\r\n" % len(payload)
            self._constant = b"".join((STATUS_LINE[200], head, length, payload))
            self._constant_head, self._constant_payload = head, payload
        return self._constant

    def _bare_scope(self, route: HotRoute) -> Any:
        """What a bare route's answer and count read of a scope, kept per connection."""
        scope: dict[str, Any] = {"type": "http", "http_version": "1.1", "method": route.method}
        scope |= {"path": route.path, "route": route.route, "headers": []}
        scope |= {"server": self.server, "client": self.client, "scheme": self.scheme}
        if self._bare_scopes is None:
            self._bare_scopes = {}
        self._bare_scopes[route.path] = scope
        return scope

    def on_message_begin(self) -> None:
        # Not idle from here (a request pipelined behind an answer comes with no new read).
        self._idle_since = None
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        cycle = self._hot_cycle()
        if cycle is None:
            before = self.cycle
            super().on_headers_complete()
            answering = self.cycle
            # No cycle is begun for a head asking to upgrade (it is parsed again): the one in
            # hand is then the last request's, answered already, perhaps a hot one (no scope).
            if answering is not None and answering is not before:
                extensions = cast(dict[str, Any], self.scope.setdefault("extensions", {}))
                extensions[ABORT] = partial(self._abort, answering)
                extensions[ON_GONE] = partial(self._on_gone, answering)
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
        self._in_message = False
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
        answering = self.cycle
        unanswered = answering is not None and not answering.response_complete
        super().connection_lost(exc)
        calls, self._gone_calls = self._gone_calls, None
        for call in calls if unanswered and calls else ():
            call()

    def _on_gone(self, cycle: Any, call: Callable[[], None]) -> Callable[[], None]:
        if cycle.disconnected:  # gone already: at once
            call()
            return _nothing
        calls = self._gone_calls
        if calls is None:
            calls = self._gone_calls = []
        calls.append(call)

        def forget() -> None:
            if call in calls:
                calls.remove(call)

        return forget

    def on_response_complete(self) -> None:
        """uvicorn's, with one keep-alive timer per connection (re-armed when it fires early)
        instead of one per answer."""
        self.server_state.total_requests += 1
        if self.transport.is_closing() or self.lingering:
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = now = self.loop.time()
        if self._idle_timer is None:
            self._idle_timer = self.loop.call_at(now + self.timeout_keep_alive, self._idle_due)

    def _abort(self, cycle: Any) -> None:
        cycle.disconnected = True  # uvicorn's cycle: an unfinished answer is then no error
        self.transport.close()

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
        """A keep-alive HTTP/1.1 request asking only for an answer, none unanswered before."""
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
        response = self._serving().error_response(exc)
        lines = [STATUS_LINE[response.status_code], self._default_head()]
        for name, value in response.raw_headers:
            if name == b"connection" and value == b"close":
                cycle.keep_alive = False
            lines += (name, b": ", value, b"\r\n")
        lines += (b"\r\n", bytes(response.body))
        self._finish(cycle, response.status_code, b"".join(lines))

    def _default_head(self) -> bytes:
        """uvicorn's ``date`` and ``server`` headers, written out once per list it makes."""
        headers = self.server_state.default_headers
        if headers is not self._head_of:
            self._head = b"".join(b"%s: %s\r\n" % pair for pair in headers)
            self._head_of = headers
        return self._head

    def _finish(self, cycle: _HotCycle, status: int, response: bytes) -> None:
        """Write ``response`` once, count it, then go on as uvicorn does after an answer."""
        cycle.response_complete = True
        elapsed_s = time.perf_counter() - cycle.started
        if not (cycle.disconnected or self.transport.is_closing() or self.lingering):
            self.transport.write(response)  # first: the client waits for nothing else
            if status == 500 or not cycle.keep_alive:
                self.end_connection()
            else:
                self.on_response_complete()
        self._observe(cycle, status, elapsed_s)

    def _observe(self, cycle: _HotCycle, status: int, elapsed_s: float | None = None) -> None:
        if elapsed_s is None:
            elapsed_s = time.perf_counter() - cycle.started
        self._serving().observe(cast(Scope, self.scope), status, elapsed_s)

    def _body_too_late(self, cycle: _HotCycle) -> None:
        """The body came too late: the app's 408, and the connection closed."""
        if self._pending is not cycle:
            return
        self._pending = None
        cycle.timer = None
        cycle.keep_alive = False
        self._send_error(cycle, body_timeout_error(self._serving().body_timeout_s))


def _nothing() -> None:
    pass


def _bare_route(hot: HotServing, data: bytes) -> HotRoute | None:
    """The bare route ``data`` is a whole plain ``GET`` of (its head kept when short), or None."""
    route = hot.bare_heads.get(data) if len(data) <= _KEPT_HEAD_BYTES else None
    if route is None:
        head = _BARE_GET.fullmatch(data)
        route = hot.bare.get(head[1]) if head is not None else None
        if (
            route is not None
            and len(data) <= _KEPT_HEAD_BYTES
            and len(hot.bare_heads) < _KEPT_HEADS
        ):
            hot.bare_heads[data] = route  # a client sends the same head every time
    return route


def _posted(hot: HotServing, head: bytes) -> _Posted | None:
    """The hot route, headers (as uvicorn lists them) and declared length of ``head``, a
    whole plain ``POST`` head up to its last header's CRLF, or None."""
    match = _POSTED_HEAD.fullmatch(head)
    route = hot.routes.get((b"POST", match[1])) if match is not None else None
    if match is None or route is None or not route.reads_body:
        return None
    raw: list[tuple[bytes, bytes]] = []
    declared: bytes | None = None
    for line in match[2].split(b"\r\n")[:-1]:
        name, _, value = line.partition(b":")
        name, value = name.lower(), value.strip(b" \t")
        if name == b"content-length":
            if declared is not None:
                return None
            declared = value
        raw.append((name, value))
    if declared is None or not declared.isdigit() or int(declared) > hot.max_body_bytes:
        return None
    return route, raw, int(declared)


def _body_fits(route: HotRoute, raw: list[tuple[bytes, bytes]], max_bytes: int) -> bool:
    """One declared length within ``max_bytes`` (0 on a bodiless route), no header for the app."""
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
    """Run ``coro`` now, as an eager task would; if it waits, the rest in a task in ``tasks``."""
    try:
        awaited = coro.send(None)
    except StopIteration:
        return
    task = loop.create_task(_resume(coro, awaited))
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def _resume(coro: Coroutine[Any, Any, None], awaited: Any) -> None:
    """Drive ``coro`` on from where it yielded ``awaited``, as a task does."""
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


def hot_protocol(
    timeout_s: float,
    hot: HotServing | None,
    *,
    linger_s: float = LingeringProtocol.linger_s,
    bad_request_body: Callable[[str], bytes] | None = None,
) -> type[HotProtocol]:
    """A protocol class with a ``timeout_s`` head deadline answering ``hot``'s plain requests,
    lingering at most ``linger_s`` on a close mid-body, a request it cannot parse answered
    400 with ``bad_request_body`` (None: uvicorn's plain text)."""
    fields = {
        "timeout_s": timeout_s,
        "hot": hot,
        "linger_s": linger_s,
        "bad_request_body": staticmethod(bad_request_body) if bad_request_body else None,
    }
    return type("HotHeadDeadline", (HotProtocol,), fields)
