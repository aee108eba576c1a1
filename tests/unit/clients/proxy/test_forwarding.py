"""The forwarder's attempts, headers and timeouts, on an in-memory transport."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import httpx
import pytest
from starlette.types import Message

from kvindex.api.http.server_protocol import ABORT
from kvindex.api.load.desk import ReservationDesk
from kvindex.api.load.model import InFlight
from kvindex.api.load.reservations import MemoryLedger, Reservation, Reservations
from kvindex.clients.proxy.connections import FRESH_CONNECTION, NothingReceivedError
from kvindex.clients.proxy.forwarding import (
    ClientGoneError,
    ClientWatch,
    Forwarder,
    Opened,
    StreamedAnswer,
    UpstreamFailedError,
    UpstreamTimeoutError,
)
from kvindex.clients.proxy.headers import REQUEST_ID, forwarded_headers, request_id_of
from kvindex.clients.proxy.metrics import ProxyMetrics
from kvindex.clients.proxy.predictions import StreamTruth, Truth
from kvindex.clients.proxy.settings import ProxySettings
from kvindex.clients.proxy.untokenized import UNTOKENIZED
from kvindex.clients.proxy.upstream import Upstream
from kvindex.indexer.domain.errors import SettingsError
from kvindex.indexer.index.protocol import IndexUnavailableError

UPSTREAMS = tuple(Upstream(f"r{i}", f"http://r{i}.test:8000") for i in (1, 2, 3))
PATH = "/v1/completions"


class Fleet:
    """A transport answering as each replica is told to: a status, or a connect error."""

    def __init__(self, **behaviour: int | str) -> None:
        self.behaviour = behaviour
        self.seen: list[tuple[str, httpx.Headers, bytes]] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        replica = request.url.host.split(".")[0]
        self.seen.append((replica, request.headers, await request.aread()))
        what = self.behaviour.get(replica, 200)
        if what == "down":
            raise httpx.ConnectError("connection refused", request=request)
        if what == "slow":
            await asyncio.sleep(5)
        assert isinstance(what, int)
        return httpx.Response(what, content=f"from {replica}".encode())


DEFAULTS = ProxySettings()


def _open(
    fleet: Fleet, settings: ProxySettings = DEFAULTS
) -> tuple[Opened | Exception, ProxyMetrics]:
    metrics = ProxyMetrics()

    async def run() -> Opened | Exception:
        forwarder = Forwarder(settings, metrics, transport=httpx.MockTransport(fleet.handle))
        try:
            headers = [("x-request-id", "abc")]
            return await forwarder.open(PATH, b"{}", headers, UPSTREAMS, forwarder.deadline())
        except Exception as exc:
            return exc
        finally:
            await forwarder.close()

    return asyncio.run(run()), metrics


def _sample(metrics: ProxyMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_the_best_replica_answers_when_it_can() -> None:
    fleet = Fleet()
    opened, metrics = _open(fleet)
    assert isinstance(opened, Opened) and opened.upstream.replica == "r1"
    assert [s[0] for s in fleet.seen] == ["r1"]
    assert _sample(metrics, "kvindex_proxy_retries_total", route=PATH) == 0


def test_a_connect_error_or_a_408_429_5xx_is_retried_on_the_next_replica() -> None:
    for failure in ("down", 408, 429, 500, 502, 503, 504):
        fleet = Fleet(r1=failure)
        opened, metrics = _open(fleet)
        assert isinstance(opened, Opened) and opened.upstream.replica == "r2", failure
        assert [s[0] for s in fleet.seen] == ["r1", "r2"]
        assert fleet.seen[0][2] == fleet.seen[1][2] == b"{}"  # the same body each time
        kind = "connect" if failure == "down" else f"status_{failure}"
        assert _sample(metrics, "kvindex_proxy_upstream_errors_total", replica="r1", kind=kind)
        assert _sample(metrics, "kvindex_proxy_retries_total", route=PATH) == 1


def test_other_answers_are_passed_on_without_retry() -> None:
    for status in (400, 401, 404, 422, 501):
        fleet = Fleet(r1=status)
        opened, _ = _open(fleet)
        assert isinstance(opened, Opened) and opened.response.status_code == status
        assert [s[0] for s in fleet.seen] == ["r1"]


def test_attempts_are_bounded_and_the_last_answer_is_passed_on() -> None:
    fleet = Fleet(r1=503, r2=503, r3=503)
    opened, _ = _open(fleet, ProxySettings(max_attempts=2))
    assert isinstance(opened, Opened) and opened.response.status_code == 503
    assert [s[0] for s in fleet.seen] == ["r1", "r2"]
    fleet = Fleet(r1="down", r2="down", r3="down")
    failed, _ = _open(fleet)
    assert isinstance(failed, UpstreamFailedError)
    assert "r1: connect" in str(failed) and "r3: connect" in str(failed)


def test_a_replica_that_does_not_answer_in_time_is_a_timeout_not_a_retry() -> None:
    fleet = Fleet(r1="slow")
    late, metrics = _open(fleet, ProxySettings(total_timeout_s=0.1))
    assert isinstance(late, UpstreamTimeoutError)
    assert [s[0] for s in fleet.seen] == ["r1"]
    assert _sample(metrics, "kvindex_proxy_upstream_errors_total", replica="r1", kind="timeout")


def test_request_id_is_honoured_or_made_and_forwarded_with_traceparent() -> None:
    assert request_id_of([("X-Request-Id", "given")]) == "given"
    made = request_id_of([("accept", "*/*")])
    assert len(made) == 32 and made != request_id_of([])
    inbound = [
        ("host", "proxy:8000"),
        ("content-length", "2"),
        ("connection", "keep-alive"),
        ("x-request-id", "old"),
        ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        ("authorization", "Bearer t"),
    ]
    sent = dict(forwarded_headers(inbound, "rid"))
    assert sent == {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "authorization": "Bearer t",
        "x-forwarded-for": "unknown",
        "forwarded": "for=unknown;proto=http",
        REQUEST_ID: "rid",
    }
    fleet = Fleet()
    _open(fleet)
    assert fleet.seen[0][1]["x-request-id"] == "abc"


@pytest.mark.parametrize(
    "name",
    [
        "connect_timeout_s",
        "first_byte_timeout_s",
        "stream_idle_timeout_s",
        "total_timeout_s",
        "hang_silence_s",
    ],
)
def test_settings_name_the_bad_key(name: str) -> None:
    zero: dict[str, Any] = {name: 0}
    with pytest.raises(SettingsError, match=re.escape(f"proxy.{name} must be a finite number > 0")):
        ProxySettings(**zero)
    with pytest.raises(SettingsError, match=re.escape("proxy.max_attempts must be an integer")):
        ProxySettings(max_attempts=0)


def test_an_answer_is_streamed_chunk_by_chunk_as_it_comes_and_byte_for_byte() -> None:
    chunks = [b'data: {"a": 1}\n\n', b"data: [DONE]\n\n"]
    sent: list[Message] = []
    first_sent = asyncio.Event()
    done: list[tuple[int, str]] = []

    async def body() -> AsyncIterator[bytes]:
        yield chunks[0]
        await asyncio.wait_for(first_sent.wait(), 2)  # buffering would never get here
        yield chunks[1]

    async def handle(request: httpx.Request) -> httpx.Response:
        headers = {"content-type": "text/event-stream", "x-request-id": "theirs"}
        return httpx.Response(200, headers=headers, content=body())

    async def send(message: Message) -> None:
        sent.append(message)
        if message.get("body") == chunks[0]:
            first_sent.set()

    async def receive() -> Message:
        await asyncio.sleep(10)  # the client stays
        return {"type": "http.disconnect"}

    async def run() -> None:
        forwarder = Forwarder(DEFAULTS, ProxyMetrics(), transport=httpx.MockTransport(handle))
        deadline = forwarder.deadline()
        opened = await forwarder.open(PATH, b"{}", [], UPSTREAMS, deadline)
        answer = StreamedAnswer(opened, "rid", deadline, lambda *a: done.append(a))
        await answer({"type": "http"}, receive, send)
        await forwarder.close()

    asyncio.run(run())
    head = dict(sent[0]["headers"])
    assert head[b"x-request-id"] == b"rid" and head[b"x-kvindex-replica"] == b"r1"
    assert head[b"content-type"] == b"text/event-stream"
    assert b"".join(m.get("body", b"") for m in sent[1:]) == b"".join(chunks)
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert done == [(200, "r1")]


def test_a_client_that_goes_away_mid_stream_closes_the_upstream_answer() -> None:
    closed = asyncio.Event()
    done: list[tuple[int, str]] = []

    async def body() -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\n"
            await asyncio.sleep(10)
            yield b"data: 2\n\n"
        finally:
            closed.set()

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body())

    async def send(message: Message) -> None:
        return None

    async def receive() -> Message:
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    async def run() -> None:
        forwarder = Forwarder(DEFAULTS, ProxyMetrics(), transport=httpx.MockTransport(handle))
        deadline = forwarder.deadline()
        opened = await forwarder.open(PATH, b"{}", [], UPSTREAMS, deadline)
        answer = StreamedAnswer(opened, "rid", deadline, lambda *a: done.append(a))
        await asyncio.wait_for(answer({"type": "http"}, receive, send), 2)
        await asyncio.wait_for(closed.wait(), 2)
        await forwarder.close()

    asyncio.run(run())
    assert done == [(200, "r1")]


def _stream_through(
    body: AsyncIterator[bytes], first_chunk_timeout_s: float, idle_timeout_s: float
) -> tuple[bytes, float]:
    """What a client receives of an answer streamed with these timeouts, and how long it
    took."""
    sent: list[Message] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body)

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        await asyncio.sleep(30)
        return {"type": "http.disconnect"}

    async def run() -> float:
        forwarder = Forwarder(DEFAULTS, ProxyMetrics(), transport=httpx.MockTransport(handle))
        deadline = forwarder.deadline()
        opened = await forwarder.open(PATH, b"{}", [], UPSTREAMS, deadline)
        answer = StreamedAnswer(
            opened,
            "rid",
            deadline,
            lambda *a: None,
            first_chunk_timeout_s=first_chunk_timeout_s,
            idle_timeout_s=idle_timeout_s,
        )
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(answer({"type": "http"}, receive, send), 10)
        await forwarder.close()
        return loop.time() - started

    took = asyncio.run(run())
    return b"".join(m.get("body", b"") for m in sent[1:]), took


def test_a_stream_idle_past_the_idle_timeout_ends_early_and_slow_chunks_within_it_do_not() -> None:
    async def stalls() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        await asyncio.sleep(0.2)
        yield b"data: 2\n\n"
        await asyncio.sleep(8)  # the replica hangs
        yield b"data: 3\n\n"

    received, took = _stream_through(stalls(), first_chunk_timeout_s=5, idle_timeout_s=1)
    assert received == b"data: 1\n\ndata: 2\n\n" and took < 6

    async def first_slow() -> AsyncIterator[bytes]:
        await asyncio.sleep(1.5)  # a long prefill: bounded by the first-chunk timeout
        yield b"data: 1\n\n"
        await asyncio.sleep(0.2)
        yield b"data: [DONE]\n\n"

    received, _ = _stream_through(first_slow(), first_chunk_timeout_s=5, idle_timeout_s=1)
    assert received == b"data: 1\n\ndata: [DONE]\n\n"


def test_authorization_is_the_replicas_key_never_the_clients_unless_told() -> None:
    fleet = Fleet(r1="down")
    settings = ProxySettings(upstream_api_key="every", replica_api_keys={"r1": "first"})
    told = ProxySettings(forward_client_authorization=True)
    metrics = ProxyMetrics()

    async def run() -> None:
        headers = [("Authorization", "Bearer client"), ("x-request-id", "abc")]
        for given, upstreams in ((settings, UPSTREAMS), (DEFAULTS, UPSTREAMS[1:])):
            forwarder = Forwarder(given, metrics, transport=httpx.MockTransport(fleet.handle))
            await forwarder.open(PATH, b"{}", headers, upstreams, forwarder.deadline())
            await forwarder.close()
        passing = Forwarder(told, metrics, transport=httpx.MockTransport(fleet.handle))
        await passing.open(PATH, b"{}", headers, UPSTREAMS[1:], passing.deadline())
        await passing.close()

    asyncio.run(run())
    sent = [(replica, seen.get_list("authorization")) for replica, seen, _ in fleet.seen]
    assert sent == [
        ("r1", ["Bearer first"]),
        ("r2", ["Bearer every"]),
        ("r2", []),
        ("r2", ["Bearer client"]),
    ]


def test_a_retry_waits_the_policys_back_off() -> None:
    fleet = Fleet(r1=503, r2=503)
    settings = ProxySettings(retry_backoff_s=0.3, retry_backoff_max_s=0.3)

    async def run() -> float:
        forwarder = Forwarder(settings, ProxyMetrics(), transport=httpx.MockTransport(fleet.handle))
        loop = asyncio.get_running_loop()
        started = loop.time()
        await forwarder.open(PATH, b"{}", [], UPSTREAMS, forwarder.deadline())
        await forwarder.close()
        return loop.time() - started

    took = asyncio.run(run())
    assert [s[0] for s in fleet.seen] == ["r1", "r2", "r3"]
    assert took >= 0.15 + 0.15  # two waits, each at least half of the 0.3 s ceiling


# --- requests in flight ---------------------------------------------------------------------


class Desk:
    """A forwarder whose attempts are reserved in a memory ledger, and what it counted."""

    def __init__(
        self, handle: Callable[[httpx.Request], Coroutine[None, None, httpx.Response]]
    ) -> None:
        self.metrics = ProxyMetrics()
        self.ledger = MemoryLedger()
        self.reservations = Reservations(self.ledger, 10.0, holder="proxy")
        self.desk = ReservationDesk(self.reservations, self.metrics.desk_series())
        transport = httpx.MockTransport(handle)
        self.forwarder = Forwarder(DEFAULTS, self.metrics, transport=transport, desk=self.desk)

    def in_flight(self) -> dict[str, InFlight]:
        return self.ledger.in_flight(["r1", "r2", "r3"])

    def gauge(self, replica: str) -> float:
        return _sample(self.metrics, "kvindex_proxy_in_flight", replica=replica)

    def released(self, reason: str) -> float:
        return _sample(self.metrics, "kvindex_proxy_reservations_released_total", reason=reason)


TOKENED = tuple(Upstream(f"r{i}", f"http://r{i}.test:8000", 100 * i) for i in (1, 2, 3))


async def _stays() -> Message:
    await asyncio.sleep(10)
    return {"type": "http.disconnect"}


async def _ignored(message: Message) -> None:
    return None


@pytest.mark.parametrize("whole", [False, True], ids=["stream", "content-length"])
def test_a_request_is_in_flight_from_dispatch_to_its_last_byte(whole: bool) -> None:
    seen: dict[str, InFlight] = {}
    at_send: list[tuple[bytes, dict[str, InFlight]]] = []
    desk: Desk

    async def body() -> AsyncIterator[bytes]:
        yield b"ans"
        yield b"wer"

    async def handle(request: httpx.Request) -> httpx.Response:
        seen.update(desk.in_flight())  # reserved before it is sent
        headers = {"content-length": "6"} if whole else {}
        return httpx.Response(200, headers=headers, content=body())

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            at_send.append((message["body"], desk.in_flight()))

    desk = Desk(handle)

    async def run() -> None:
        deadline = desk.forwarder.deadline()
        opened = await desk.forwarder.open(PATH, b"{}", [], TOKENED, deadline)
        assert desk.in_flight() == {"r1": InFlight(1, 100)} and desk.gauge("r1") == 1
        await StreamedAnswer(opened, "rid", deadline, lambda *a: None)({}, _stays, send)
        await desk.forwarder.close()

    asyncio.run(run())
    assert seen == {"r1": InFlight(1, 100)}
    # in flight until the replica's last byte; released before the client sees the end
    assert at_send[0] == (b"ans", {"r1": InFlight(1, 100)})
    assert at_send[1] == (b"wer", {} if whole else {"r1": InFlight(1, 100)})
    assert at_send[-1] == (b"", {})
    assert desk.in_flight() == {} and desk.gauge("r1") == 0
    assert desk.released("done") == 1 and desk.reservations.num_held() == 0


def test_a_failed_attempt_is_released_and_the_retry_reserved_on_its_own_replica() -> None:
    fleet = Fleet(r1="down", r2=503)
    desk = Desk(fleet.handle)

    async def run() -> None:
        opened = await desk.forwarder.open(PATH, b"{}", [], TOKENED, desk.forwarder.deadline())
        assert opened.upstream.replica == "r3"
        assert desk.in_flight() == {"r3": InFlight(1, 300)}
        assert opened.dispatch is not None
        await opened.dispatch.release("done")
        await opened.dispatch.release("done")  # once only
        await desk.forwarder.close()

    asyncio.run(run())
    assert desk.released("error") == 2 and desk.released("done") == 1
    assert desk.in_flight() == {} and [desk.gauge(r) for r in ("r1", "r2", "r3")] == [0, 0, 0]


def test_a_client_gone_before_the_answer_aborts_the_attempt_and_releases_it() -> None:
    started, aborted = asyncio.Event(), asyncio.Event()

    async def handle(request: httpx.Request) -> httpx.Response:
        started.set()
        try:
            await asyncio.sleep(10)  # a non-streaming answer: generation takes a while
        except asyncio.CancelledError:
            aborted.set()
            raise
        return httpx.Response(200)

    desk = Desk(handle)

    async def gone() -> Message:
        await started.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        deadline = desk.forwarder.deadline()
        with pytest.raises(ClientGoneError):
            await asyncio.wait_for(
                desk.forwarder.open(PATH, b"{}", [], TOKENED, deadline, receive=gone), 2
            )
        await asyncio.wait_for(aborted.wait(), 2)
        await desk.forwarder.close()

    asyncio.run(run())
    assert desk.released("disconnect") == 1 and desk.in_flight() == {}
    assert desk.gauge("r1") == 0


def test_a_client_gone_mid_stream_releases_its_request() -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        await asyncio.sleep(10)
        yield b"data: 2\n\n"

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body())

    async def gone() -> Message:
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    desk = Desk(handle)

    async def run() -> None:
        deadline = desk.forwarder.deadline()
        # as the app does: the one receive of the request, watched from the open on
        opened = await desk.forwarder.open(PATH, b"{}", [], TOKENED, deadline, receive=gone)
        answer = StreamedAnswer(opened, "rid", deadline, lambda *a: None)
        await asyncio.wait_for(answer({}, _stays, _ignored), 2)
        await desk.forwarder.close()

    asyncio.run(run())
    assert desk.released("disconnect") == 1 and desk.in_flight() == {}


def test_a_cancellation_that_is_not_the_clients_passes_through_the_watch() -> None:
    """A request cancelled by the server (its shutdown, say) is not a client gone."""
    started = asyncio.Event()

    async def handle(request: httpx.Request) -> httpx.Response:
        started.set()
        await asyncio.sleep(10)
        return httpx.Response(200)

    desk = Desk(handle)

    async def run() -> None:
        deadline = desk.forwarder.deadline()
        opening = asyncio.ensure_future(
            desk.forwarder.open(PATH, b"{}", [], TOKENED, deadline, receive=_stays)
        )
        await asyncio.wait_for(started.wait(), 2)
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        await desk.forwarder.close()

    asyncio.run(run())
    assert desk.in_flight() == {} and desk.released("disconnect") == 1


def test_a_client_gone_between_the_open_and_the_stream_ends_the_stream_at_once() -> None:
    sent: list[Message] = []

    async def body() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body())

    async def gone() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    desk = Desk(handle)

    async def run() -> None:
        deadline = desk.forwarder.deadline()
        opened = await desk.forwarder.open(PATH, b"{}", [], TOKENED, deadline, receive=gone)
        await asyncio.sleep(0.01)  # the watch hears of it before the stream starts
        await StreamedAnswer(opened, "rid", deadline, lambda *a: None)({}, _stays, send)
        await desk.forwarder.close()

    asyncio.run(run())
    assert [m["type"] for m in sent] == ["http.response.start"]  # no body: nobody reads it
    assert desk.released("disconnect") == 1 and desk.in_flight() == {}


class _DownLedger(MemoryLedger):
    def reserve(self, holder: str, lease_ttl_s: float, reservation: Reservation) -> bool:
        raise IndexUnavailableError("redis: connection refused")


def test_an_unreachable_store_never_fails_a_request() -> None:
    desk = Desk(Fleet().handle)
    desk.desk = ReservationDesk(Reservations(_DownLedger(), 10.0), desk.metrics.desk_series())
    desk.forwarder = Forwarder(
        DEFAULTS, desk.metrics, transport=httpx.MockTransport(Fleet().handle), desk=desk.desk
    )

    async def run() -> None:
        opened = await desk.forwarder.open(PATH, b"{}", [], TOKENED, desk.forwarder.deadline())
        assert opened.upstream.replica == "r1" and desk.gauge("r1") == 1
        assert opened.dispatch is not None
        await opened.dispatch.release("done")
        await desk.forwarder.close()

    asyncio.run(run())
    assert _sample(desk.metrics, "kvindex_proxy_reservation_failures_total", op="reserve") == 1
    assert desk.gauge("r1") == 0 and desk.released("done") == 1


def test_closing_the_desk_releases_what_is_still_reserved() -> None:
    desk = Desk(Fleet().handle)

    async def run() -> None:
        await desk.forwarder.open(PATH, b"{}", [], TOKENED, desk.forwarder.deadline())
        await desk.desk.close()
        await desk.forwarder.close()

    asyncio.run(run())
    assert desk.in_flight() == {} and desk.released("shutdown") == 1


def test_the_first_attempt_is_reserved_before_the_loop_runs_anything_else() -> None:
    """With an in-process store, a request chosen right after this one sees it in flight."""
    desk = Desk(Fleet().handle)

    async def run() -> None:
        deadline = desk.forwarder.deadline()
        opening = asyncio.ensure_future(
            desk.forwarder.open(PATH, b"{}", [], TOKENED, deadline, receive=_stays)
        )
        await asyncio.sleep(0)  # one step of the open: up to its first wait
        assert desk.in_flight() == {"r1": InFlight(1, 100)}
        opened = await opening
        assert opened.dispatch is not None
        await opened.dispatch.release("done")
        await desk.forwarder.close()

    asyncio.run(run())
    assert desk.in_flight() == {} and desk.released("done") == 1


def test_a_client_gone_at_once_leaves_nothing_reserved() -> None:
    desk = Desk(Fleet(r1="slow").handle)

    async def gone() -> Message:
        return {"type": "http.disconnect"}

    async def run() -> None:
        deadline = desk.forwarder.deadline()
        with pytest.raises(ClientGoneError):
            await desk.forwarder.open(PATH, b"{}", [], TOKENED, deadline, receive=gone)
        await desk.forwarder.close()

    asyncio.run(run())
    assert desk.in_flight() == {} and desk.released("disconnect") == 1
    assert desk.gauge("r1") == 0


class Drops:
    """A transport whose connections end before any byte as told: ``how[replica]`` is a list
    of what each next request there meets (``stale``, ``dropped``, ``abandoned``, or 200)."""

    def __init__(self, **how: list[str | int]) -> None:
        self.how = how
        self.seen: list[tuple[str, bool]] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        replica = request.url.host.split(".")[0]
        self.seen.append((replica, bool(request.extensions.get(FRESH_CONNECTION))))
        plan = self.how.get(replica, [])
        what = plan.pop(0) if plan else 200
        if what == "stale":
            raise NothingReceivedError("closed before any byte", reused=True)
        if what == "dropped":
            raise NothingReceivedError("reset before any byte", reused=False)
        if what == "abandoned":
            raise NothingReceivedError("hung", reused=False, abandoned=True)
        assert isinstance(what, int)
        return httpx.Response(what, content=replica.encode())


def _open_over(drops: Drops) -> tuple[Opened | Exception, ProxyMetrics, list[tuple[str, bool]]]:
    """The first answer worth passing on over ``drops``, and the breaker's outcomes."""
    metrics, outcomes = ProxyMetrics(), []

    async def run() -> Opened | Exception:
        forwarder = Forwarder(
            ProxySettings(retry_backoff_s=0),
            metrics,
            transport=httpx.MockTransport(drops.handle),
            on_outcome=lambda replica, ok, _what: outcomes.append((replica, ok)),
        )
        try:
            return await forwarder.open(PATH, b"{}", [], UPSTREAMS, forwarder.deadline())
        except Exception as exc:
            return exc
        finally:
            await forwarder.close()

    return asyncio.run(run()), metrics, outcomes


def test_a_kept_alive_connection_closed_before_any_byte_is_sent_again_on_a_new_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    drops = Drops(r1=["stale"])
    opened, metrics, outcomes = _open_over(drops)
    assert isinstance(opened, Opened) and opened.upstream.replica == "r1"
    assert drops.seen == [("r1", False), ("r1", True)]  # the same replica, a new connection
    assert outcomes == [("r1", True)]  # its breaker never heard of the stale connection
    assert _sample(metrics, "kvindex_proxy_upstream_errors_total", replica="r1", kind="stale")
    assert "retry on replica r1 after stale connection" in caplog.text


def test_a_connection_that_ends_before_any_byte_is_retried_elsewhere() -> None:
    drops = Drops(r1=["stale", "dropped"], r2=["dropped"])
    opened, metrics, outcomes = _open_over(drops)
    assert isinstance(opened, Opened) and opened.upstream.replica == "r3"
    assert [r for r, _ in drops.seen] == ["r1", "r1", "r2", "r3"]
    assert outcomes == [("r1", False), ("r2", False), ("r3", True)]
    assert _sample(metrics, "kvindex_proxy_retries_total", route=PATH) == 2


def test_a_request_abandoned_on_a_hung_replica_goes_elsewhere_not_against_its_breaker(
    caplog: pytest.LogCaptureFixture,
) -> None:
    opened, metrics, outcomes = _open_over(Drops(r1=["abandoned"]))
    assert isinstance(opened, Opened) and opened.upstream.replica == "r2"
    assert outcomes == [("r2", True)]
    assert _sample(metrics, "kvindex_proxy_upstream_errors_total", replica="r1", kind="abandoned")
    assert "retry on replica r2 after r1: abandoned" in caplog.text


def test_every_connection_ending_before_any_byte_is_a_502() -> None:
    opened, _, _ = _open_over(Drops(r1=["dropped"], r2=["dropped"], r3=["stale", "dropped"]))
    assert isinstance(opened, UpstreamFailedError)
    assert "r3: dropped" in str(opened)


def test_an_answer_broken_mid_body_is_cut_by_the_servers_abort_and_counted() -> None:
    sent: list[Message] = []
    aborted: list[bool] = []

    async def body() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        raise httpx.RemoteProtocolError("the replica closed the connection")

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body())

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    metrics = ProxyMetrics()

    async def run() -> None:
        forwarder = Forwarder(DEFAULTS, metrics, transport=httpx.MockTransport(handle))
        deadline = forwarder.deadline()
        opened = await forwarder.open(PATH, b"{}", [], UPSTREAMS, deadline)
        answer = StreamedAnswer(opened, "rid", deadline, lambda *a: None)
        scope = {"type": "http", "extensions": {ABORT: lambda: aborted.append(True)}}
        await asyncio.wait_for(answer(scope, receive, send), 5)
        await forwarder.close()

    asyncio.run(run())
    assert aborted == [True]
    assert [m.get("more_body") for m in sent[1:]] == [True]  # the end never sent
    assert _sample(metrics, "kvindex_proxy_upstream_errors_total", replica="r1", kind="cut") == 1


class Server:
    """The server's ``on_gone``: the calls it holds, made when the client goes."""

    def __init__(self) -> None:
        self.calls: list[Callable[[], None]] = []
        self.gone = False

    def on_gone(self, call: Callable[[], None]) -> Callable[[], None]:
        if self.gone:
            call()
            return lambda: None
        self.calls.append(call)
        return lambda: self.calls.remove(call) if call in self.calls else None

    def go(self) -> None:
        self.gone = True
        calls, self.calls = self.calls, []
        for call in calls:
            call()


@pytest.mark.parametrize("told", [False, True], ids=["receive", "on_gone"])
def test_a_client_watch_told_by_the_server_acts_as_one_reading_receive(told: bool) -> None:
    """The two ways a watch learns of the client's going give the same outcomes: the guarded
    wait ends with ClientGoneError, a watch made after the going raises at once, and a
    stopped watch leaves nothing behind (no call held, no task)."""
    server = Server()
    went = asyncio.Event()

    async def receive() -> Message:
        await went.wait()
        return {"type": "http.disconnect"}

    def watch() -> ClientWatch:
        return ClientWatch(receive, server.on_gone if told else None)

    def go() -> None:
        went.set()
        server.go()

    async def run() -> None:
        during = watch()
        asyncio.get_running_loop().call_later(0.05, go)
        with pytest.raises(ClientGoneError), during.guard():
            await asyncio.sleep(5)
        during.stop()
        with pytest.raises(ClientGoneError):
            after = watch()
            with after.guard():
                await asyncio.sleep(0)  # the task reads its disconnect here
                await asyncio.sleep(5)
        after.stop()
        quiet = Server()
        kept = ClientWatch(asyncio.Event().wait, quiet.on_gone if told else None)  # type: ignore[arg-type]
        with kept.guard():
            await asyncio.sleep(0)
        kept.stop()
        assert quiet.calls == [] and not kept.gone

    asyncio.run(asyncio.wait_for(run(), 3))


def _told_truth(body: AsyncIterator[bytes], client_leaves_s: float) -> tuple[list[Any], bytes]:
    """What ``on_truth`` was told of a streamed answer whose client leaves after
    ``client_leaves_s``, and the head's header lines (the answer given ``UNTOKENIZED``)."""
    told: list[Any] = []
    sent: list[Message] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        await asyncio.sleep(client_leaves_s)
        return {"type": "http.disconnect"}

    async def run() -> None:
        forwarder = Forwarder(DEFAULTS, ProxyMetrics(), transport=httpx.MockTransport(handle))
        deadline = forwarder.deadline()
        opened = await forwarder.open(PATH, b"{}", [], UPSTREAMS, deadline)
        answer = StreamedAnswer(
            opened,
            "rid",
            deadline,
            lambda *a: None,
            truth=StreamTruth(hide=False),
            on_truth=told.append,
            extra_headers=(UNTOKENIZED,),
        )
        await asyncio.wait_for(answer({"type": "http"}, receive, send), 5)
        await forwarder.close()

    asyncio.run(run())
    return told, b"".join(v for n, v in sent[0]["headers"] if n == UNTOKENIZED[0])


_USAGE = (
    b'data: {"usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}}\n\n'
)


def test_a_streams_usage_read_counts_though_its_client_left_at_done() -> None:
    """The openai client closes at ``[DONE]``, before the body's last chunk."""

    async def body() -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"text": "x"}]}\n\n' + _USAGE + b"data: [DONE]\n\n"
        await asyncio.sleep(10)  # the chunk that ends the body comes late
        yield b""

    told, header = _told_truth(body(), client_leaves_s=0.05)
    assert told == [Truth(40, 32)] and header == b"failed"


def test_a_stream_left_before_its_usage_tells_nothing() -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"text": "x"}]}\n\n'
        await asyncio.sleep(10)
        yield _USAGE

    told, _ = _told_truth(body(), client_leaves_s=0.05)
    assert told == []
