"""Two ``kvindex proxy --store redis`` on one real redis-server share the route journal: the
receipts of both land in one Stream trimmed to ``proxy.journal_stream_maxlen``, and either
proxy finds a receipt the other wrote."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import msgspec
import pytest
import redis

from kvindex.clients.proxy.receipt import Receipt
from kvindex.indexer.redis.schema import Schema
from tests.integration.harness import wait_until
from tests.integration.test_proxy import MODEL, Sim, _sim
from tests.support.processes import http_ok, kvindex_child
from tests.support.redis_server import RedisServer, free_port

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis_server]
MAXLEN = 20
NODE_ENTRIES = 5
"""``stream-node-max-entries`` while the test runs: ``MAXLEN ~`` trims whole nodes."""


@pytest.fixture
def small_nodes(redis_client: redis.Redis) -> Iterator[None]:
    before = str(redis_client.config_get("stream-node-max-entries")["stream-node-max-entries"])
    redis_client.config_set("stream-node-max-entries", NODE_ENTRIES)
    yield
    redis_client.config_set("stream-node-max-entries", before)


@pytest.fixture
def proxies(redis_server: RedisServer, small_nodes: None, tmp_path: Path) -> Iterator[list[str]]:
    """Base URLs of two proxies on one Redis, which one indexer fills from two sims."""
    config = tmp_path / "kvindex.toml"
    config.write_text(f"[proxy]\njournal_entries = 1000\njournal_stream_maxlen = {MAXLEN}\n")
    with ExitStack() as stack:
        sims: list[Sim] = [_sim(rid, tmp_path) for rid in ("r1", "r2")]
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
        urls = []
        for number in range(2):
            port = free_port()
            command = ["proxy", "--port", str(port), "--store", "redis", "--config", str(config)]
            command += ["--redis-url", redis_server.url]
            log = tmp_path / f"proxy{number}.log"
            proxy = kvindex_child(f"proxy {number}", command, log, http_ok(port, "/readyz"))
            stack.callback(proxy.stop)
            proxy.start(40)
            urls.append(f"http://127.0.0.1:{port}")
        yield urls


def _send(url: str, request_id: str) -> None:
    body = {"model": MODEL, "prompt": f"shared words of the journal test {request_id}"}
    answer = httpx.post(
        f"{url}/v1/completions",
        json={**body, "max_tokens": 2},
        headers={"x-request-id": request_id},
        trust_env=False,
        timeout=30,
    )
    assert answer.status_code == 200, answer.text


def _ids(url: str, limit: int) -> list[str]:
    answer = httpx.get(f"{url}/decisions", params={"limit": limit}, trust_env=False)
    assert answer.status_code == 200, answer.text
    return [r.id for r in msgspec.json.decode(answer.content, type=list[Receipt])]


def test_two_proxies_share_one_stream_trimmed_to_its_maxlen(
    proxies: list[str], redis_client: redis.Redis
) -> None:
    first, second = proxies
    _send(first, "from-first")
    _send(second, "from-second")
    both = {"from-first", "from-second"}
    wait_until(lambda: set(_ids(first, 10)) == both, what="both receipts in the Stream")
    assert set(_ids(second, 10)) == both  # the shared Stream's, whichever proxy is asked
    mine = httpx.get(f"{second}/decisions/from-first", trust_env=False)
    assert mine.status_code == 200 and mine.json()["id"] == "from-first"
    num_sent = 3 * MAXLEN
    for number in range(num_sent):
        _send(proxies[number % 2], f"many-{number}")
    for url in proxies:
        _ids(url, 1)  # a listing writes this proxy's pending receipts first
    length = redis_client.xlen(Schema("kvindex").receipts)
    print(f"stream length after {num_sent + 2} receipts, MAXLEN ~ {MAXLEN}: {length}")
    assert MAXLEN <= length <= MAXLEN + NODE_ENTRIES
    newest = _ids(first, MAXLEN)
    assert len(newest) == MAXLEN and {"many-58", "many-59"} <= set(newest)
    assert all(int(i.removeprefix("many-")) >= num_sent - 2 * MAXLEN for i in newest)
    # many-0 went through the first proxy: its memory keeps it, the Stream no more
    assert httpx.get(f"{first}/decisions/many-0", trust_env=False).status_code == 200
    assert httpx.get(f"{second}/decisions/many-0", trust_env=False).status_code == 404
