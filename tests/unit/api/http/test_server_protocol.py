"""The hot path's eager runner: a coroutine run in the callback, the rest in a task.

:func:`~kvindex.api.http.server_protocol._run_eagerly` must do what a task would, whether the
coroutine finishes at once, waits on futures (their results and errors reach it), yields a
bare loop turn, or is cancelled while it waits. The protocol itself is tested over real
sockets (``tests/integration/test_server_protocol.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.datastructures import Headers

from kvindex.api.http.hot_routes import HotRoute
from kvindex.api.http.server_protocol import _BARE_GET, _body_fits, _run_eagerly


def _eagerly(coro: Any) -> set[asyncio.Task[None]]:
    tasks: set[asyncio.Task[None]] = set()
    _run_eagerly(coro, asyncio.get_running_loop(), tasks)
    return tasks


def test_a_coroutine_that_does_not_wait_finishes_in_the_call() -> None:
    done: list[str] = []

    async def answer() -> None:
        done.append("answered")

    async def main() -> None:
        assert _eagerly(answer()) == set()
        assert done == ["answered"]

    asyncio.run(main())


def test_a_coroutine_that_waits_goes_on_in_a_task_with_every_result() -> None:
    seen: list[object] = []

    async def answer(first: asyncio.Future[int], second: asyncio.Future[int]) -> None:
        seen.append(await first)
        await asyncio.sleep(0)  # a bare yield
        try:
            await second
        except ValueError as exc:
            seen.append(str(exc))
        seen.append(await asyncio.to_thread(lambda: "threaded"))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        first, second = loop.create_future(), loop.create_future()
        tasks = _eagerly(answer(first, second))
        assert seen == [] and len(tasks) == 1
        first.set_result(7)
        await asyncio.sleep(0.01)
        second.set_exception(ValueError("bad"))
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert seen == [7, "bad", "threaded"]
        assert tasks == set()  # the server's set forgets a finished task

    asyncio.run(main())


def test_a_cancelled_wait_is_thrown_into_the_coroutine() -> None:
    seen: list[str] = []

    async def answer(never: asyncio.Future[None]) -> None:
        try:
            await never
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def main() -> None:
        (task,) = _eagerly(answer(asyncio.get_running_loop().create_future()))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen == ["cancelled"]

    asyncio.run(main())


def test_an_error_after_a_wait_ends_the_task_with_it() -> None:
    async def answer() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("late")

    async def main() -> None:
        (task,) = _eagerly(answer())
        with pytest.raises(RuntimeError, match="late"):
            await task

    asyncio.run(main())


@pytest.mark.parametrize(
    ("reads_body", "headers", "fits"),
    [
        (True, {"content-length": "10"}, True),
        (True, {"content-length": "11"}, False),
        (True, {"content-length": "-1"}, False),
        (True, {}, False),
        (True, {"transfer-encoding": "chunked"}, False),
        (True, {"content-length": "10", "x-forwarded-for": "10.0.0.1"}, False),
        (False, {}, True),
        (False, {"content-length": "0"}, True),
        (False, {"content-length": "2"}, False),
    ],
)
def test_a_hot_request_is_one_whose_body_is_declared_within_the_limit(
    reads_body: bool, headers: dict[str, str], fits: bool
) -> None:
    async def answer(_body: bytes, _headers: Headers) -> bytes:
        return b"{}"

    route = HotRoute("POST", "/score", None, answer, guarded=False, reads_body=reads_body)
    raw = [(name.encode(), value.encode()) for name, value in headers.items()]
    assert _body_fits(route, raw, 10) is fits


@pytest.mark.parametrize(
    ("sent", "bare"),
    [
        (b"GET /healthz HTTP/1.1\r\n\r\n", True),
        (b"GET /healthz HTTP/1.1\r\nHost: a:1\r\nAccept: */*\r\nUser-Agent: x/1 (y)\r\n\r\n", True),
        (b"GET /healthz HTTP/1.1\r\nx-empty:\r\nx-tab:\ta\tb\r\n\r\n", True),
        (b"GET /healthz HTTP/1.1\r\nContent-Length: 0\r\n\r\n", False),
        (b"GET /healthz HTTP/1.1\r\nTRANSFER-ENCODING: chunked\r\n\r\n", False),
        (b"GET /healthz HTTP/1.1\r\nConnection: keep-alive\r\n\r\n", False),
        (b"GET /healthz HTTP/1.1\r\nupgrade: h2c\r\n\r\n", False),
        (b"GET /healthz HTTP/1.1\r\nExpect: 100-continue\r\n\r\n", False),
        (b"GET /healthz HTTP/1.1\r\nX-Forwarded-For: 10.0.0.1\r\n\r\n", False),
        (b"GET /healthz HTTP/1.1\r\nhost : a\r\n\r\n", False),
        (b"GET /healthz HTTP/1.1\r\n host: a\r\n\r\n", False),
        (b"GET /healthz HTTP/1.1\r\nx: \xc3\xa9\r\n\r\n", False),
        (b"GET /healthz HTTP/1.1\r\nx: a\x00\r\n\r\n", False),
        (b"GET /healthz HTTP/1.1\nhost: a\n\n", False),
        (b"GET /healthz HTTP/1.0\r\n\r\n", False),
        (b"get /healthz HTTP/1.1\r\n\r\n", False),
        (b"GET /healthz HTTP/1.1\r\n\r\nGET /healthz HTTP/1.1\r\n\r\n", False),
        (b"GET /healthz HTTP/1.1\r\n\r\n{}", False),
        (b"GET /healthz HTTP/1.1\r\nhost: a\r\n", False),
    ],
)  # fmt: skip
def test_a_bare_head_is_one_plain_get_asking_for_nothing_more(sent: bytes, bare: bool) -> None:
    """What the protocol answers before its parser (the rest is the parser's)."""
    assert (_BARE_GET.fullmatch(sent) is not None) is bare
