"""``kvindex proxy --workers 2`` as a user meets it: chat completions through the real
``openai`` package answered by both worker processes on one port, each scrape showing both
workers' series, a killed worker forked again, and SIGTERM to the parent stopping every
worker (no orphan, the port closed). Every part is a real process: ``kvindex replica-sim``s
and the proxy (memory store)."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.integration.test_proxy_forwarding import MODEL, Proxy, _start

pytestmark = pytest.mark.timeout(90)
_WORKER = re.compile(r'kvindex_proxy_worker_info\{pid="(\d+)",worker="(\d+)"\} 1\.0')
_CHATS = re.compile(
    r'kvindex_proxy_requests_total\{worker="(\d+)",replica="\w+",'
    r'route="/v1/chat/completions",status="200"\} (\S+)'
)


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def _children(pid: int) -> set[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return {int(child) for child in text.split()}


def _alive(pid: int) -> bool:
    """Running, and not a zombie waiting for its parent."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _poll(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


def _chat(proxy: Proxy, text: str, *, stream: bool = False) -> str:
    """One chat completion on a new connection (the kernel picks the worker); its text."""
    with proxy.client() as client:
        if stream:
            chunks = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": text}], stream=True
            )
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}]
        )
        return answer.choices[0].message.content or ""


def _worker_chats(proxy: Proxy) -> dict[int, int]:
    """Chat completions answered so far by each worker's pid, read from one scrape (which
    carries every worker's series, labelled ``worker``)."""
    metrics = proxy.metrics()
    pids = {worker: int(pid) for pid, worker in _WORKER.findall(metrics)}
    seen = dict.fromkeys(pids.values(), 0)
    for worker, count in _CHATS.findall(metrics):
        seen[pids[worker]] += int(float(count))
    return seen


def test_two_workers_share_the_port_and_stop_together(stack: ExitStack, tmp_path: Path) -> None:
    _, proxy = _start(stack, tmp_path, {"r1": [], "r2": []}, ("--workers", "2"))
    parent = proxy.child.process
    assert parent is not None
    workers = _children(parent.pid)
    assert len(workers) == 2

    answered: dict[int, int] = {}
    for number in range(48):  # until both workers have answered one
        assert _chat(proxy, f"question {number} " * 20, stream=number % 2 == 1)
        if number % 8 == 7:
            answered = _worker_chats(proxy)
            assert set(answered) == workers  # any one scrape: both workers' series
            if all(answered.values()):
                break
    assert all(answered.values()), answered
    failures = re.search(
        r"^kvindex_proxy_worker_scrape_failures_total\{worker=\"0\"\} (\S+)$", proxy.metrics(), re.M
    )
    assert failures is not None and float(failures.group(1)) == 0

    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=30) == 0
    _poll(lambda: not any(_alive(pid) for pid in workers), 10, "the workers ended")
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", proxy.port)):
        pass


def test_a_killed_worker_is_forked_again(stack: ExitStack, tmp_path: Path) -> None:
    _, proxy = _start(stack, tmp_path, {"r1": []}, ("--workers", "2"))
    parent = proxy.child.process
    assert parent is not None
    workers = _children(parent.pid)
    victim = min(workers)
    # A worker dead within 5 s of its start is a crash loop (the parent gives up): older.
    started = os.stat(f"/proc/{victim}").st_mtime
    _poll(lambda: time.time() - started > 5.5, 15, "the worker is 5 s old")
    os.kill(victim, signal.SIGKILL)
    _poll(lambda: len(_children(parent.pid) - {victim}) == 2, 30, "a new worker")
    for number in range(6):
        assert _chat(proxy, f"again {number} " * 20)
    assert parent.poll() is None
    replaced = _children(parent.pid)
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=30) == 0
    _poll(lambda: not any(_alive(pid) for pid in replaced), 10, "the workers ended")
