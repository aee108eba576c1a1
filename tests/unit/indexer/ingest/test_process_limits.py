"""process_limits: the open-file limit raised (never lowered), the socket limit sized to it."""

from __future__ import annotations

import resource
from collections.abc import Iterator

import pytest
import zmq

from kvindex.indexer.ingest.process_limits import (
    ZMQ_DEFAULT_MAX_SOCKETS,
    describe_limits,
    file_limit,
    files_needed,
    raise_file_limit,
    sized_context,
)


@pytest.fixture
def low_soft_limit() -> Iterator[int]:
    """The soft open-file limit lowered to 512 for the test (restored after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the hard open-file limit {hard} leaves no room to raise the soft one")
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    try:
        yield hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_soft_limit_is_raised_to_what_is_asked_then_to_the_hard_limit(
    low_soft_limit: int,
) -> None:
    before, after = raise_file_limit(1024)
    assert (before.soft, after.soft, after.hard) == (512, 1024, low_soft_limit)
    assert raise_file_limit(600)[1].soft == 1024  # never lowered
    before, after = raise_file_limit()
    assert before.soft == 1024 and after.soft == min(low_soft_limit, 1_048_576)
    assert file_limit() == after


def test_a_wish_above_the_hard_limit_stops_at_the_hard_limit(low_soft_limit: int) -> None:
    hard = low_soft_limit if low_soft_limit != resource.RLIM_INFINITY else 1_048_576
    assert raise_file_limit(hard + 1)[1].soft == hard


@pytest.mark.parametrize(
    ("num_files", "max_sockets"),
    [(100, ZMQ_DEFAULT_MAX_SOCKETS), (20_000, 20_000), (10**7, None)],
)
def test_the_socket_limit_follows_the_file_limit(num_files: int, max_sockets: int | None) -> None:
    context = sized_context(num_files)
    try:
        ceiling = context.get(zmq.SOCKET_LIMIT)
        assert context.get(zmq.MAX_SOCKETS) == (ceiling if max_sockets is None else max_sockets)
        assert f"ZeroMQ sockets per context {context.get(zmq.MAX_SOCKETS)}" in describe_limits(
            context
        )
    finally:
        context.term()


def test_the_files_a_fleet_needs() -> None:
    assert files_needed(2000) == 8000 and files_needed(2000, num_replays=10) == 8020
