"""``kvindex proxy --store redis`` next to ``kvindex indexer --store redis``: the proxy
reads the fleet, the index and the load the indexer writes (as ``kvindex api`` does), and
two proxies on one Redis route a repeated prompt to the same replica."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest
import redis

from tests.integration.test_proxy import (
    MODEL,
    Messages,
    Sim,
    _ask,
    _conversation,
    _sim,
    _until_cached,
)
from tests.support.processes import http_ok, kvindex_child
from tests.support.redis_server import RedisServer, free_port

pytestmark = [pytest.mark.timeout(60), pytest.mark.redis_server]


def _client(port: int) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key="unused",
        max_retries=0,
        timeout=20,
        http_client=openai.DefaultHttpxClient(trust_env=False),
    )


@pytest.fixture
def proxies(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> Iterator[tuple[int, int]]:
    """Ports of two proxies on one Redis, which one indexer fills from three replica-sims."""
    with ExitStack() as stack:
        sims: list[Sim] = [_sim(rid, tmp_path) for rid in ("r1", "r2", "r3")]
        for sim in sims:
            stack.callback(sim.child.stop)
            sim.child.spawn()
        for sim in sims:
            sim.child.wait_ready(40)
        args = ["indexer", "--store", "redis", "--redis-url", redis_server.url]
        args += ["--status-port", "-1", "--stats-every", "0"]
        for sim in sims:
            args += ["--replica", sim.spec]
        indexer = kvindex_child("indexer", args, tmp_path / "indexer.log", lambda: True)
        stack.callback(indexer.stop)
        indexer.spawn()
        ports = free_port(), free_port()
        for number, port in enumerate(ports):
            command = ["proxy", "--port", str(port), "--store", "redis"]
            command += ["--redis-url", redis_server.url]
            log = tmp_path / f"proxy{number}.log"
            proxy = kvindex_child(f"proxy {number}", command, log, http_ok(port, "/readyz"))
            stack.callback(proxy.stop)
            proxy.start(40)
        yield ports


def test_two_proxies_on_one_redis_send_a_repeated_prompt_to_its_holder(
    proxies: tuple[int, int],
) -> None:
    with _client(proxies[0]) as first, _client(proxies[1]) as second:
        assert [m.id for m in first.models.list().data] == [MODEL]  # the fleet, from Redis
        messages: Messages = _conversation("lanterns")  # type: ignore[assignment]
        assert _ask(first, messages)[1] == 0
        _until_cached(second, messages)  # the indexer has written the first answer's blocks
        answers = [_ask(client, messages) for client in (first, second, first, second)]
        assert all(cached >= 64 for _, cached in answers), answers
        assert len({replica for replica, _ in answers}) == 1, answers
