"""The forwarder: one request sent to the chosen replica, its answer streamed back as is.

Attempts follow :mod:`.retry_policy` while nothing reached the client, else a 502 (504: a
timeout); headers as :mod:`.headers` makes them, ``Authorization`` the replica's key (the
client's by ``proxy.forward_client_authorization``). A client gone closes the upstream; each
attempt is reserved in the load store and released once (a store down never fails a request)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import httpx
from starlette.types import Receive, Scope, Send

from kvindex.api.http.server_protocol import ABORT, ON_GONE
from kvindex.api.load.desk import Dispatch, ReservationDesk
from kvindex.clients.proxy.connections import (
    FRESH_CONNECTION,
    AnswerBody,
    NothingReceivedError,
    RawAnswer,
    RawRequest,
    ReplicaTransport,
    encoded_post,
)
from kvindex.clients.proxy.hang_watch import Confirm, HangWatch
from kvindex.clients.proxy.headers import (
    HEADER_ENCODING,
    HOP_BY_HOP,
    REPLICA_HEADER,
    REQUEST_ID,
)
from kvindex.clients.proxy.metrics import ProxyMetrics
from kvindex.clients.proxy.predictions import AnswerTruth, StreamTruth, Truth
from kvindex.clients.proxy.retry_policy import RetryPolicy
from kvindex.clients.proxy.settings import ProxySettings
from kvindex.clients.proxy.upstream import Upstream
from kvindex.indexer.domain.errors import KvIndexError

logger = logging.getLogger("kvindex.proxy")
_MAX_URLS = 4096
_REQUEST_ID, _REPLICA = REQUEST_ID.encode(), REPLICA_HEADER.encode()
_OURS = frozenset({*(n.encode() for n in HOP_BY_HOP), _REQUEST_ID, _REPLICA})
"""An answer's headers not passed on: hop-by-hop, and those the proxy sets itself."""


Answer = httpx.Response | RawAnswer
"""A replica's answer: a raw one over :class:`ReplicaTransport` (plain HTTP), else httpx's."""


class UpstreamFailedError(KvIndexError):
    """No replica answered (every attempt failed, or one failed past retrying): 502."""


class UpstreamTimeoutError(KvIndexError):
    """A replica did not answer in time (first byte or total timeout): 504."""


class ClientGoneError(KvIndexError):
    """The client went away before the answer started (499: nobody reads the answer)."""


RELEASE_REASONS = ("done", "error", "disconnect", "shutdown")
"""Why a request stopped being in flight (last byte sent, failure, client gone, shutdown)."""


@dataclass(frozen=True, slots=True)
class Opened:
    """A replica's answer whose headers have arrived; its body is not read yet."""

    upstream: Upstream
    response: Answer
    dispatch: Dispatch | None = None
    """The request in flight (released by the answer once its last byte is sent)."""
    watch: ClientWatch | None = None
    on_cut: Callable[[], None] | None = None
    """Called when the answer's body breaks before its end (counted)."""


class Forwarder:
    """Sends requests straight to a transport it owns (no client's cookies, redirects or
    auth), by default a :class:`~.connections.ReplicaTransport`."""

    def __init__(
        self,
        settings: ProxySettings,
        metrics: ProxyMetrics,
        transport: httpx.AsyncBaseTransport | None = None,
        retry: RetryPolicy | None = None,
        *,
        desk: ReservationDesk | None = None,
        on_outcome: Callable[[str, bool, str], None] = lambda _replica, _ok, _what: None,
        confirm_hang: Confirm | None = None,
    ) -> None:
        """``confirm_hang``: the health probe of a silent replica; with it (and the default
        transport) a :class:`~.hang_watch.HangWatch` runs while the forwarder is open."""
        self._settings = settings
        self._metrics = metrics
        self._retry = retry or RetryPolicy(settings)
        self._desk = desk or ReservationDesk(None, metrics.desk_series())
        self._on_outcome = on_outcome
        # The head's and the chunks' waits are bounded on the loop (first byte, idle); the
        # transport's own timeouts (TLS: httpx's) are only the backstop of both.
        timeout = httpx.Timeout(
            connect=settings.connect_timeout_s,
            read=max(settings.first_byte_timeout_s, settings.stream_idle_timeout_s),
            write=settings.first_byte_timeout_s,
            pool=settings.connect_timeout_s,
        )
        self._extensions = {"timeout": timeout.as_dict()}
        self._target_to_url: dict[tuple[str, str], httpx.URL] = {}
        """(replica URL, path) → the parsed URL; cleared when full."""
        self._upstream = transport or ReplicaTransport(
            max_connections=settings.max_connections,
            connect_timeout_s=settings.connect_timeout_s,
        )
        self._raw = isinstance(self._upstream, ReplicaTransport)
        """Requests go as bytes (:meth:`ReplicaTransport.send_raw`) where they can."""
        self._hangs = (
            HangWatch(self._upstream, settings.hang_silence_s, confirm_hang)
            if confirm_hang is not None and isinstance(self._upstream, ReplicaTransport)
            else None
        )

    async def close(self) -> None:
        if self._hangs is not None:
            await self._hangs.stop()
        await self._upstream.aclose()

    def abandon(self, replica: str, why: str) -> int:
        """Send elsewhere the requests waiting on ``replica`` with no byte yet; how many."""
        return 0 if self._hangs is None else self._hangs.abandon(replica, why)

    def _url(self, root: str, path: str) -> httpx.URL:
        url = self._target_to_url.get((root, path))
        if url is None:
            if len(self._target_to_url) >= _MAX_URLS:
                self._target_to_url.clear()
            url = self._target_to_url[(root, path)] = httpx.URL(root.rstrip("/") + path)
        return url

    def deadline(self) -> float:
        return asyncio.get_running_loop().time() + self._settings.total_timeout_s

    async def _reserve(self, upstream: Upstream) -> Dispatch:
        return await self._desk.reserve(upstream.replica, upstream.num_uncached_tokens)

    async def open(
        self,
        path: str,
        body: bytes,
        headers: list[tuple[str, str]],
        upstreams: Sequence[Upstream],
        deadline: float,
        *,
        method: str = "POST",
        route: str | None = None,
        receive: Receive | None = None,
        on_gone: OnGone | None = None,
    ) -> Opened:
        """The first answer worth passing on, ``path`` (and query) appended to each URL;
        UpstreamFailedError, UpstreamTimeoutError or ClientGoneError when none is (the
        client watched through ``receive``, or ``on_gone`` when the server gives it)."""
        attempts = self._retry.attempts(upstreams)
        if self._hangs is not None and not self._hangs.running:
            await self._hangs.start()
        first = await self._reserve(attempts[0]) if attempts else None
        watch = None if receive is None else ClientWatch(receive, on_gone)
        opening = self._attempts(
            path, body, headers, attempts, deadline, method=method, route=route, first=first
        )
        try:
            if watch is None:
                return await opening
            with watch.guard():
                opened = await opening
            return Opened(opened.upstream, opened.response, opened.dispatch, watch, opened.on_cut)
        except BaseException as exc:
            if watch is not None:
                watch.stop()
            if first is not None:  # an attempt cancelled before it ran holds it still
                gone = isinstance(exc, ClientGoneError | asyncio.CancelledError)
                await first.release("disconnect" if gone else "error")
            raise

    async def _attempts(
        self,
        path: str,
        body: bytes,
        headers: list[tuple[str, str]],
        attempts: Sequence[Upstream],
        deadline: float,
        *,
        method: str,
        route: str | None,
        first: Dispatch | None,
    ) -> Opened:
        failures: list[str] = []
        for number, upstream in enumerate(attempts, start=1):
            if number > 1:
                self._metrics.retries.labels(route or path).inc()
                _log_retry(headers, upstream.replica, failures[-1])
                await asyncio.sleep(self._retry.backoff_s(number))
            sent = with_api_key(
                headers,
                self._settings.api_key_of(upstream.replica),
                keep_client=self._settings.forward_client_authorization,
            )
            request = self._request(method, self._url(upstream.url, path), body, sent)
            if self._hangs is not None:
                self._hangs.note(upstream.replica, request.url)
            reserved = first if number == 1 else None
            dispatch = reserved or await self._reserve(upstream)
            response = await self._sent(request, upstream, deadline, failures, dispatch=dispatch)
            if response is None:
                continue
            if self._retry.retries_status(response.status_code) and number < len(attempts):
                self._failed(upstream, f"status_{response.status_code}", failures)
                await response.aclose()
                await dispatch.release("error")
                continue
            status = response.status_code
            self._on_outcome(upstream.replica, status < 500, f"status_{status}")
            return Opened(upstream, response, dispatch, on_cut=self._counter(upstream, "cut"))
        raise UpstreamFailedError(f"no replica answered: {'; '.join(failures) or 'none to try'}")

    def _request(
        self, method: str, url: httpx.URL, body: bytes, headers: list[tuple[str, str]]
    ) -> httpx.Request | RawRequest:
        """The request to send: a POST with a body to a plain-HTTP replica in its wire form
        at once (the header values the client's bytes again), else httpx's."""
        if self._raw and method == "POST" and body and url.scheme == "http":
            encoded = encoded_post(url, headers, body, HEADER_ENCODING)
            return RawRequest(url, encoded, headers, self._extensions)
        return httpx.Request(
            method,
            url,
            content=body,
            headers=httpx.Headers(headers, encoding=HEADER_ENCODING),  # the client's bytes
            extensions=self._extensions,
        )

    async def _sent(
        self,
        request: httpx.Request | RawRequest,
        upstream: Upstream,
        deadline: float,
        failures: list[str],
        *,
        dispatch: Dispatch,
    ) -> Answer | None:
        try:
            response = await self._send(request, upstream, deadline, failures)
        except asyncio.CancelledError:
            await dispatch.release("disconnect")
            raise
        except BaseException:
            await dispatch.release("error")
            raise
        if response is None:
            await dispatch.release("error")
        return response

    async def _send(
        self,
        request: httpx.Request | RawRequest,
        upstream: Upstream,
        deadline: float,
        failures: list[str],
    ) -> Answer | None:
        """The answer's head, or None after a failure the next replica may retry."""
        first_byte = asyncio.get_running_loop().time() + self._settings.first_byte_timeout_s
        until = min(deadline, first_byte)
        try:
            if isinstance(request, RawRequest):  # the transport keeps the time (one timer)
                return await self._head(request, upstream, until)
            async with asyncio.timeout_at(until):
                return await self._head(request, upstream)
        except httpx.HTTPError as exc:
            if not self._retry.retries_error(exc):
                self._fatal(upstream, exc, failures)
            self._failed(upstream, _kind(exc), failures, exc)
            return None
        except TimeoutError as exc:
            self._fatal(upstream, exc, failures)

    def _fatal(self, upstream: Upstream, exc: Exception, failures: list[str]) -> NoReturn:
        """A failure no other replica may retry: 504 after a timeout, else 502."""
        if isinstance(exc, httpx.TimeoutException | TimeoutError):
            self._failed(upstream, "timeout", failures, exc)
            late = f"replica {upstream.replica} did not answer in time"
            raise UpstreamTimeoutError(late) from exc
        self._failed(upstream, "protocol", failures, exc)
        raise UpstreamFailedError(f"replica {upstream.replica} failed: {exc!r}") from exc

    async def _head(
        self, request: httpx.Request | RawRequest, upstream: Upstream, until: float | None = None
    ) -> Answer:
        """The answer's head (a raw request's by ``until``, loop time: else TimeoutError);
        sent once more on a new connection when a kept-alive one ended before any byte
        (counted as ``stale``, logged, not against the replica)."""
        try:
            return await self._handled(request, until)
        except NothingReceivedError as exc:
            if not self._retry.again_on_new_connection(exc):
                raise
            self._metrics.upstream_errors.labels(upstream.replica, "stale").inc()
            sent = request.headers if isinstance(request, RawRequest) else request.headers.items()
            _log_retry(sent, upstream.replica, f"stale connection ({exc})")
        request.extensions = {**request.extensions, FRESH_CONNECTION: True}
        return await self._handled(request, until)

    async def _handled(
        self, request: httpx.Request | RawRequest, until: float | None = None
    ) -> Answer:
        if isinstance(request, RawRequest):
            assert isinstance(self._upstream, ReplicaTransport)
            return await self._upstream.send_raw(request, until)
        return await self._upstream.handle_async_request(request)

    def _failed(
        self, upstream: Upstream, kind: str, failures: list[str], exc: Exception | None = None
    ) -> None:
        self._metrics.upstream_errors.labels(upstream.replica, kind).inc()
        if kind in ("connect", "protocol", "dropped") or kind.startswith("status_5"):
            self._on_outcome(upstream.replica, False, kind)
        failures.append(f"{upstream.replica}: {kind}" + (f" ({exc!r})" if exc else ""))

    def _counter(self, upstream: Upstream, kind: str) -> Callable[[], None]:
        """Counts one ``kind`` failure of ``upstream`` when called (its series found then)."""
        errors = self._metrics.upstream_errors
        return lambda: errors.labels(upstream.replica, kind).inc()


def _kind(exc: httpx.HTTPError) -> str:
    """The ``kind`` label of a retried failure (abandoned: the replica is ejected as hung
    already, so its breaker does not count it)."""
    if isinstance(exc, NothingReceivedError):
        return "abandoned" if exc.abandoned else "dropped"
    return "connect"


def _log_retry(headers: Iterable[tuple[str, str]], replica: str, why: str) -> None:
    request_id = next((v for n, v in headers if n.lower() == REQUEST_ID), "-")
    logger.warning("request %s: retry on replica %s after %s", request_id, replica, why)


def with_api_key(
    headers: list[tuple[str, str]], key: str | None, *, keep_client: bool = False
) -> list[tuple[str, str]]:
    """``headers`` with ``Authorization: Bearer <key>`` in place of the client's; without a
    key, none (``keep_client``: the client's, as it is)."""
    if key is None and keep_client:
        return headers
    kept = [(n, v) for n, v in headers if n.lower() != "authorization"]
    if key is None:
        return kept
    return [*kept, ("authorization", f"Bearer {key}")]


class StreamedAnswer:
    """An ASGI response passing an opened answer on chunk by chunk as it arrives."""

    def __init__(
        self,
        opened: Opened,
        request_id: str,
        deadline: float,
        on_done: Callable[[int, str], None],
        *,
        first_chunk_timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        truth: AnswerTruth | None = None,
        on_truth: Callable[[Truth | None], object] | None = None,
        extra_headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        """``truth`` reads the engine's ``usage``; ``on_truth`` gets it once a 200 is sent;
        ``extra_headers`` go on the answer after the replica's."""
        self.opened = opened
        self.request_id = request_id
        self.deadline = deadline
        self.on_done = on_done
        self.first_chunk_timeout_s = first_chunk_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.truth = truth
        self.on_truth = on_truth
        self.extra_headers = extra_headers
        self._abort: Callable[[], None] | None = None
        self._length: bytes | None = None
        self._num_bytes = 0
        """Body bytes read from the replica so far."""
        self._num_whole: int | None = None
        """The body's length, when the replica said it (a number)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = self.opened.response
        self._reason = "error"  # until the last byte is sent
        self._abort = scope.get("extensions", {}).get(ABORT)
        watch = self.opened.watch
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": self._headers(),
                }
            )
            self._length = _content_length(response)
            if self._length is not None and isinstance(self.truth, StreamTruth):
                self.truth.hide = False  # the length is the client's: nothing dropped
            if self._length is not None:
                if watch is not None:
                    watch.stop()  # a whole answer, already coming: nothing to abort
                await self._send_known(send)
            else:
                watch = watch or ClientWatch(receive, on_gone_of(scope))
                await self._stream_watched(send, watch)
        finally:
            if watch is not None:
                watch.stop()
            await response.aclose()
            self.on_done(response.status_code, self.opened.upstream.replica)
            if self.on_truth is not None and self.truth is not None:
                self._tell_truth(response, self.on_truth, self.truth.truth)
            if self.opened.dispatch is not None:
                await self.opened.dispatch.release(self._reason)

    def _tell_truth(
        self, response: Answer, on_truth: Callable[[Truth | None], object], truth: Truth | None
    ) -> None:
        """A 200 answer sent to its end, or one whose usage was read before the client left
        (a stream's client may close at ``[DONE]``, before the body's last chunk)."""
        if response.status_code == 200 and (self._reason == "done" or truth is not None):
            on_truth(truth)

    def _headers(self) -> list[tuple[bytes, bytes]]:
        """The replica's header lines as it sent them, less the hop-by-hop ones and ours."""
        kept = [(n, v) for n, v in _raw_headers(self.opened.response) if n.lower() not in _OURS]
        return [
            *kept,
            (_REQUEST_ID, self.request_id.encode("latin-1")),
            (_REPLICA, self.opened.upstream.replica.encode("latin-1")),
            *self.extra_headers,
        ]

    async def _stream_watched(self, send: Send, watch: ClientWatch) -> None:
        try:
            with watch.guard():
                await self._stream(send)
        except ClientGoneError:
            self._reason = "disconnect"

    async def _stream(self, send: Send) -> None:
        """Every chunk; past a deadline or broken upstream, the body ends early."""
        length = self._length
        self._num_bytes, self._num_whole = 0, None
        if length is not None and length.isdigit():
            self._num_whole = int(length)
        stream = self.opened.response.stream
        ended = await (
            self._stream_raw(send, stream)
            if isinstance(stream, AnswerBody)
            else self._stream_httpx(send)
        )
        if ended is False:
            await self._done()
            rest = b"" if self.truth is None else self.truth.end()
            await send({"type": "http.response.body", "body": rest, "more_body": False})

    async def _stream_raw(self, send: Send, stream: AnswerBody) -> bool | None:
        """:meth:`_stream_httpx` on the connection: each wait bounded by one timer of its
        own (first chunk, then idle), the total deadline by one context; whether the end
        went with the last chunk (None: cut)."""
        loop = asyncio.get_running_loop()
        deadline, idle_s = self.deadline, self.first_chunk_timeout_s
        ended = False
        try:
            async with asyncio.timeout_at(deadline):  # a send held by a slow client too
                while not ended:
                    until = deadline if idle_s is None else min(deadline, loop.time() + idle_s)
                    read = await stream.read(until)
                    if read is None:
                        return False
                    ended = await self._pass_on(read, send)
                    idle_s = self.idle_timeout_s
        except (TimeoutError, httpx.HTTPError) as exc:
            why = "past the total deadline" if isinstance(exc, TimeoutError) else repr(exc)
            if isinstance(exc, TimeoutError) and loop.time() < deadline:
                why = "no chunk within the idle timeout"
            self._cut(why)
            return None
        return True

    async def _stream_httpx(self, send: Send) -> bool | None:
        """Every chunk of an httpx answer (TLS), within the deadline and idle timeouts;
        whether the end went with the last chunk (None: cut)."""
        idle_s, loop = self.idle_timeout_s, asyncio.get_running_loop()
        idle = asyncio.timeout(self.first_chunk_timeout_s)
        ended = False  # the client has been told the body ends
        try:
            async with asyncio.timeout_at(self.deadline), idle:
                async for read in _raw(self.opened.response):
                    idle.reschedule(None)  # a slow client is not an idle replica
                    ended = await self._pass_on(read, send)
                    idle.reschedule(None if idle_s is None else loop.time() + idle_s)
        except (TimeoutError, httpx.HTTPError) as exc:
            why = "past the total deadline" if isinstance(exc, TimeoutError) else repr(exc)
            why = "no chunk within the idle timeout" if idle.expired() else why
            self._cut(why)
            return None
        return ended

    async def _pass_on(self, read: bytes, send: Send) -> bool:
        """``read`` sent on (what the usage reader leaves of it: maybe nothing); whether
        the body's end went with it."""
        self._num_bytes += len(read)
        ended = _all_read(self.opened.response)  # then the end goes with this chunk
        chunk = read
        truth = self.truth
        if truth is not None:
            chunk = truth.feed(read) + (truth.end() if ended else b"")
            if not chunk and not ended:
                return False  # all of it held, or the hidden usage chunk
        whole = self._num_whole
        if ended or (whole is not None and self._num_bytes >= whole):
            await self._done()  # the client has it all with this chunk
        await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
        return ended

    async def _send_known(self, send: Send) -> None:
        """A body of known length: whole when its rest comes in the first wait (one timer,
        as :meth:`_stream`'s first chunk is awaited), else chunk by chunk."""
        response = self.opened.response
        stream = response.stream
        if isinstance(stream, AnswerBody) and not stream.whole():
            idle_s = self.first_chunk_timeout_s
            until = self.deadline
            if idle_s is not None:
                until = min(until, asyncio.get_running_loop().time() + idle_s)
            try:
                await stream.arrival(until)
            except TimeoutError:
                late = until >= self.deadline
                self._cut("past the total deadline" if late else "no chunk within the idle timeout")
                return
        await (self._send_whole(send) if _whole(response) else self._stream(send))

    async def _send_whole(self, send: Send) -> None:
        """A body that has all come, in one message: nothing is awaited from the replica
        (the one write is buffered whole), so no timeout is armed."""
        stream = self.opened.response.stream
        body = stream.take_whole() if isinstance(stream, AnswerBody) else None
        if body is None:
            chunks = [read async for read in _raw(self.opened.response)]
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        truth = self.truth
        if truth is not None:
            body = truth.feed(body) + truth.end()
        await self._done()
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _cut(self, why: str) -> None:
        """The head is sent: the client learns that the body breaks off here the way HTTP/1.1
        says it, by its connection closing before the body's end (the server's abort)."""
        logger.warning("answer from %s cut: %s", self.opened.upstream.replica, why)
        if self.opened.on_cut is not None:
            self.opened.on_cut()
        if self._abort is not None:
            self._abort()

    async def _done(self) -> None:
        """Released before the client sees the end, so a request at once is not counted twice."""
        self._reason = "done"
        if self.opened.dispatch is not None:
            await self.opened.dispatch.release("done")


def _raw_headers(response: Answer) -> list[tuple[bytes, bytes]]:
    return response.raw_headers if isinstance(response, RawAnswer) else response.headers.raw


def _content_length(response: Answer) -> bytes | None:
    """The answer's ``Content-Length`` as sent, joined as httpx's ``get`` does (None: none)."""
    values = [v for n, v in _raw_headers(response) if n.lower() == b"content-length"]
    return None if not values else b", ".join(values)


def _raw(response: Answer) -> AsyncIterator[bytes]:
    """Reference: httpx.Response.aiter_raw; tests/unit/clients/proxy/test_connections.py::test_the_end_of_an_answer_goes_to_the_client_with_its_last_chunk
    The body's chunks as they come: straight from the connection over ReplicaTransport
    (httpx's iterator only counts and wraps the same chunks there), else httpx's."""  # noqa: E501
    stream = response.stream
    if isinstance(stream, AnswerBody):
        return stream.__aiter__()
    assert isinstance(response, httpx.Response)  # a RawAnswer's stream is an AnswerBody
    return response.aiter_raw()


def _whole(response: Answer) -> bool:
    """The body has all come (known only over ReplicaTransport)."""
    stream = response.stream
    return isinstance(stream, AnswerBody) and stream.whole()


def _all_read(response: Answer) -> bool:
    """The body has all come with the chunk just read (known only over ReplicaTransport)."""
    stream = response.stream
    return isinstance(stream, AnswerBody) and stream.all_read()


OnGone = Callable[[Callable[[], None]], Callable[[], None]]
"""The server's :data:`~kvindex.api.http.server_protocol.ON_GONE`: a call, and its forgetter."""


def on_gone_of(scope: Scope) -> OnGone | None:
    """The server's way to learn that the client went, when it has one."""
    extensions: dict[str, Any] = scope.get("extensions") or {}
    return extensions.get(ON_GONE)


class ClientWatch:
    """Notices a client going away: inside :meth:`guard` the request's task is cancelled and
    the guard raises :class:`ClientGoneError`. With the server's ``on_gone`` it is told;
    else one task reads ``receive`` until ``http.disconnect``."""

    def __init__(self, receive: Receive, on_gone: OnGone | None = None) -> None:
        self._receive = receive
        self._on_gone = on_gone
        self._forget: Callable[[], None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._owner: asyncio.Task[Any] | None = None
        self._cancelled = False
        self._stopped = False
        self.gone = False

    def guard(self) -> ClientWatch:
        if self._task is None and self._forget is None and not self._stopped:
            if self._on_gone is not None:
                self._forget = self._on_gone(self._went)
            else:
                self._task = asyncio.ensure_future(self._watch())
        return self

    def __enter__(self) -> None:
        if self.gone:
            raise ClientGoneError("the client went away")
        self._owner = asyncio.current_task()

    def __exit__(self, kind: type[BaseException] | None, exc: object, tb: object) -> None:
        owner, self._owner = self._owner, None
        if not self._cancelled:
            return
        self._cancelled = False
        if owner is not None:
            owner.uncancel()
        if kind is asyncio.CancelledError:
            raise ClientGoneError("the client went away") from None

    def stop(self) -> None:
        self._stopped = True
        forget, self._forget = self._forget, None
        if forget is not None:
            forget()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def _watch(self) -> None:
        try:
            while (await self._receive())["type"] != "http.disconnect":
                pass
        except Exception as exc:  # nobody left to read the answer either
            logger.debug("reading the client's messages failed: %r", exc)
        self._went()

    def _went(self) -> None:
        self.gone = True
        if self._owner is not None and not self._stopped:
            self._cancelled = True
            self._owner.cancel()
