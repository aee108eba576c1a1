"""Where the long-running commands listen: a port in use is one line naming the option to
change, and ``replica-sim`` says whether its events PUB binds or connects (subprocesses)."""

from __future__ import annotations

import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes import KVINDEX
from tests.support.redis_server import free_port

pytestmark = pytest.mark.timeout(90)

NO_REPLAY = ["--replay", ""]


@pytest.fixture
def taken() -> Iterator[int]:
    """A loopback port something listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def kvindex(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(KVINDEX), *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(
    ("command", "extra"),
    [
        ("serve", []),
        ("api", ["--redis-url", "redis://127.0.0.1:1/0"]),
        ("proxy", []),
        ("replica-sim", ["--events", "tcp://127.0.0.1:*", *NO_REPLAY]),
    ],
)
def test_a_port_in_use_is_one_line_naming_the_option(
    taken: int, command: str, extra: list[str]
) -> None:
    done = kvindex(command, "--port", str(taken), *extra)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"Error: port {taken} on 127.0.0.1 is in use: choose another with --port"
    ]
    assert "http://" not in done.stdout  # no banner before the failure


@pytest.mark.parametrize("option", ["--events", "--replay"])
def test_a_replica_sims_endpoint_in_use_names_its_option(taken: int, option: str) -> None:
    endpoints = {"--events": "tcp://127.0.0.1:*", "--replay": "tcp://127.0.0.1:*"}
    endpoints[option] = f"tcp://127.0.0.1:{taken}"
    args = [arg for pair in endpoints.items() for arg in pair]
    done = kvindex("replica-sim", "--port", "0", "--bind-events", *args)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"Error: tcp://127.0.0.1:{taken} is in use: choose another with {option}"
    ]


def first_line(tmp_path: Path, *args: str) -> str:
    """The line ``kvindex replica-sim *args`` prints once it runs (then it is stopped)."""
    with (
        (tmp_path / "stderr.log").open("wb") as stderr,
        subprocess.Popen(
            [str(KVINDEX), "replica-sim", "--port", "0", *NO_REPLAY, *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        ) as process,
    ):
        try:
            assert process.stdout is not None
            return process.stdout.readline().strip()
        finally:
            process.terminate()
            process.wait(timeout=10)


def test_replica_sim_says_whether_its_events_bind_or_connect(tmp_path: Path) -> None:
    """vLLM's rule: an endpoint without '*' is connected to, unless --bind-events."""
    port = free_port()
    where = f"tcp://127.0.0.1:{port}"
    assert f"events: connects to {where} " in first_line(tmp_path, "--events", where)
    assert f"events: binds {where} " in first_line(tmp_path, "--events", where, "--bind-events")
    bound = first_line(tmp_path, "--events", "tcp://127.0.0.1:*")
    assert re.search(r"events: binds tcp://127\.0\.0\.1:\d+ ", bound), bound
