"""The retry policy: which statuses, how many attempts, how long between them."""

from __future__ import annotations

import random

import httpx

from kvindex.clients.proxy.connections import NothingReceivedError
from kvindex.clients.proxy.retry_policy import RetryPolicy
from kvindex.clients.proxy.settings import ProxySettings


def test_retried_statuses_are_those_a_replica_sends_before_running_the_request() -> None:
    retried = [s for s in range(100, 600) if RetryPolicy.retries_status(s)]
    assert retried == [408, 429, 500, 502, 503, 504]


def test_attempts_are_bounded() -> None:
    policy = RetryPolicy(ProxySettings(max_attempts=2))
    assert policy.attempts(["a", "b", "c"]) == ["a", "b"]
    assert policy.attempts(["a"]) == ["a"]


def test_backoff_doubles_is_capped_and_jittered() -> None:
    settings = ProxySettings(retry_backoff_s=0.1, retry_backoff_max_s=0.3)
    policy = RetryPolicy(settings, random.Random(3))
    assert policy.backoff_s(1) == 0.0
    for number, ceiling in ((2, 0.1), (3, 0.2), (4, 0.3), (9, 0.3)):
        waits = {policy.backoff_s(number) for _ in range(50)}
        assert all(ceiling / 2 <= w <= ceiling for w in waits), (number, waits)
        assert len(waits) > 40  # drawn, not fixed: failed requests do not retry together
    assert RetryPolicy(ProxySettings(retry_backoff_s=0)).backoff_s(3) == 0.0


def test_a_kept_alive_connection_ending_before_any_byte_is_tried_again_on_a_new_one() -> None:
    stale = NothingReceivedError("closed", reused=True)
    fresh = NothingReceivedError("closed", reused=False)
    abandoned = NothingReceivedError("hung", reused=False, abandoned=True)
    assert RetryPolicy.again_on_new_connection(stale)
    assert not RetryPolicy.again_on_new_connection(fresh)
    assert not RetryPolicy.again_on_new_connection(abandoned)
    assert not RetryPolicy.again_on_new_connection(httpx.ConnectError("refused"))


def test_failures_with_no_byte_of_the_answer_go_to_the_next_replica_others_do_not() -> None:
    retried = [
        httpx.ConnectError("refused"),
        httpx.ConnectTimeout("slow"),
        NothingReceivedError("reset", reused=False),
        NothingReceivedError("hung", reused=False, abandoned=True),
    ]
    assert all(RetryPolicy.retries_error(exc) for exc in retried)
    not_retried = [
        httpx.RemoteProtocolError("the answer broke off"),  # bytes of it had come
        httpx.ReadTimeout("no answer in time"),
    ]
    assert not any(RetryPolicy.retries_error(exc) for exc in not_retried)
