"""Each ``replica-sim --lie`` caught by the proxy's verdicts, named by its reason, and, for
lost removals and a restart with events off, healed: real replica-sims over ZeroMQ, the real
proxy (memory store: it asks its own write path to drop the lying replica's blocks; Redis
store: the ask goes through Redis to a ``kvindex indexer``)."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from kvindex.indexer.redis.schema import Schema
from tests.integration.test_proxy_forwarding import MODEL, Proxy, _start, stack
from tests.support.processes import Child, http_ok, kvindex_child
from tests.support.redis_server import RedisServer, free_port

__all__ = ["stack"]
pytestmark = pytest.mark.timeout(120)
DETECT_WITHIN = 80
"""Requests after the lie starts biting within which its verdict (or outcome) is named."""
HEAL_WITHIN = 60
"""Requests after the verdict within which the replica's predictions are exact again (its
discount lifted: ``exact_to_trust`` exact since its last over-prediction)."""


def _prompt(prefix: int, rng: random.Random) -> str:
    """A 40-word start shared by all of ``prefix`` (2 blocks of 16), then 8 words of its own."""
    shared = " ".join(f"p{prefix}w{i}" for i in range(40))
    return shared + " " + " ".join(f"u{rng.randrange(10**9)}" for _ in range(8))


def _send(http: httpx.Client, prefix: int, rng: random.Random) -> str:
    body = {"model": MODEL, "prompt": _prompt(prefix, rng), "max_tokens": 2}
    answer = http.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.headers["x-kvindex-replica"]


def _view(http: httpx.Client, rid: str) -> dict[str, Any]:
    """The proxy's ``/replicas`` ``predictions`` of ``rid`` (a request is counted once its
    answer is done on the proxy's side: just after the client has it)."""
    time.sleep(0.01)
    views = {v["id"]: v for v in http.get("/replicas").json()}
    predictions: dict[str, Any] = views[rid]["predictions"]
    return predictions


def _series(proxy: Proxy, name: str) -> dict[str, float]:
    """Samples of one ``kvindex_proxy_*`` series: labels text → value."""
    pattern = rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$"
    return {labels: float(v) for labels, v in re.findall(pattern, proxy.metrics(), re.M)}


def _until_verdict(
    http: httpx.Client, rid: str, prefixes: Sequence[int], rng: random.Random
) -> int:
    """Requests over ``prefixes`` until ``rid`` is found over-predicted: how many."""
    for sent in range(1, DETECT_WITHIN + 1):
        _send(http, rng.choice(prefixes), rng)
        if _view(http, rid)["verdict"]["num_verdicts"]:
            return sent
    raise AssertionError(f"no verdict on {rid} within {DETECT_WITHIN}: {_view(http, rid)}")


def _until_cleared(http: httpx.Client, rid: str) -> float:
    """Seconds until ``rid``'s stream reads partial, its blocks dropped by the verdict (the
    write path carries an ask out at its next maintenance, about once a second)."""
    started = time.monotonic()
    while time.monotonic() - started < 10:
        views = {v["id"]: v for v in http.get("/replicas").json()}
        streams = views[rid]["streams"]  # none until the fleet sync publishes the stream
        if streams and streams[0]["freshness"].get("partial") == "cleared_on_over_predictions":
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"{rid}'s blocks not dropped: {views[rid]['streams']}")


def _until_trusted(http: httpx.Client, rid: str, prefixes: range, rng: random.Random) -> int:
    for sent in range(1, HEAL_WITHIN + 1):
        _send(http, rng.choice(prefixes), rng)
        if not _view(http, rid)["verdict"]["distrusted"]:
            return sent
    raise AssertionError(f"{rid} still distrusted after {HEAL_WITHIN}: {_view(http, rid)}")


def test_lost_removals_are_found_cleared_and_healed(stack: ExitStack, tmp_path: Path) -> None:
    """r2 evicts without telling: with 20 prefixes over 16-block caches the index soon routes
    to blocks r2 no longer has; the verdict drops r2's blocks and discounts it; once the
    traffic fits in the caches (evictions, and so the lie, stop biting) r2 is exact again."""
    small = ["--capacity-blocks", "16"]
    sims = {"r1": small, "r2": [*small, "--lie", "drop-removals"]}
    _, proxy = _start(stack, tmp_path, sims)
    rng = random.Random(13)
    with httpx.Client(base_url=proxy.base_url, trust_env=False, timeout=30) as http:
        found_at = _until_verdict(http, "r2", range(20), rng)
        view = _view(http, "r2")
        print(f"drop-removals: over-predicted verdict after {found_at} requests: {view}")
        assert view["over_predicted"] >= 3 and view["verdict"]["distrusted"]
        assert _series(proxy, "kvindex_proxy_distrusted_replicas") == {"": 1.0}
        print(f"drop-removals: r2's blocks dropped {_until_cleared(http, 'r2'):.2f} s after")
        healed_at = _until_trusted(http, "r2", range(100, 102), rng)
        print(f"drop-removals: exact again {healed_at} requests after: {_view(http, 'r2')}")
        assert _view(http, "r1")["verdict"]["num_verdicts"] == 0
    assert _series(proxy, "kvindex_proxy_verdicts_total")['{verdict="over_predicted"}'] >= 1
    assert _series(proxy, "kvindex_proxy_distrusted_replicas") == {"": 0.0}


def test_a_restart_with_events_off_is_found_cleared_and_healed(
    stack: ExitStack, tmp_path: Path
) -> None:
    """r2 restarts empty after its 8th answer and says nothing: the 8 prefixes the index
    credits it alone with come back over-predicted; once its blocks are dropped, the same
    prefixes and new ones make it exact again."""
    sims = {"r1": [], "r2": ["--lie", "events-off-restart=8"]}
    _, proxy = _start(stack, tmp_path, sims)
    rng = random.Random(17)
    with httpx.Client(base_url=proxy.base_url, trust_env=False, timeout=30) as http:
        on_r2: list[int] = []  # new prefixes, each once: r2's are its alone
        for prefix in range(40):
            if len(on_r2) < 8 and _send(http, prefix, rng) == "r2":
                on_r2.append(prefix)
        assert len(on_r2) == 8 and _view(http, "r2")["over_predicted"] == 0
        found_at = _until_verdict(http, "r2", on_r2, rng)
        view = _view(http, "r2")
        print(f"events-off restart: over-predicted verdict {found_at} requests after it: {view}")
        print(f"events-off restart: r2's blocks dropped {_until_cleared(http, 'r2'):.2f} s after")
        healed_at = _until_trusted(http, "r2", range(40), rng)  # its 8, r1's, new ones
        print(f"events-off restart: exact again {healed_at} requests after: {_view(http, 'r2')}")


def test_another_block_size_in_the_events_is_named(stack: ExitStack, tmp_path: Path) -> None:
    """r2 caches in the fleet's 16-token blocks but cuts its events in 32: its answers are
    under-predicted, named ``block_size``, from its first repeated prefix on."""
    _, proxy = _start(stack, tmp_path, {"r1": [], "r2": ["--lie", "block-size=32"]})
    rng = random.Random(19)
    with httpx.Client(base_url=proxy.base_url, trust_env=False, timeout=30) as http:
        sent = 0
        while sent < DETECT_WITHIN and not _view(http, "r2")["verdict"]["under_predicted"]:
            sent += 1
            _send(http, rng.randrange(3), rng)
        view = _view(http, "r2")
        print(f"block-size=32: named after {sent} requests: {view}")
        assert view["verdict"]["under_predicted"] == {"block_size": view["under_predicted"]}
    under = _series(proxy, "kvindex_proxy_under_predictions_total")
    assert under['{reason="block_size"}'] >= 1 and under['{reason="lost_stores"}'] == 0


def test_a_tokenizer_counting_otherwise_is_named_once(stack: ExitStack, tmp_path: Path) -> None:
    """r2 counts one token more per prompt: the first answer of r2 is a token mismatch, the
    model is logged once with both counts and the route, counted, and named by /readyz."""
    _, proxy = _start(stack, tmp_path, {"r1": [], "r2": ["--lie", "tokenizer"]})
    rng = random.Random(23)
    with httpx.Client(base_url=proxy.base_url, trust_env=False, timeout=30) as http:
        sent = 0
        while sent < DETECT_WITHIN and not _view(http, "r2")["token_mismatch"]:
            sent += 1
            routed = _send(http, rng.randrange(4), rng)
        print(f"tokenizer: token_mismatch after {sent} requests (the last to {routed})")
        for _ in range(10):
            _send(http, rng.randrange(4), rng)
        ready = http.get("/readyz")
    print(f"/readyz: {ready.json()}")
    assert sent <= DETECT_WITHIN and ready.status_code == 200
    assert "model 'demo-model'" in ready.json()["detail"]
    assert _series(proxy, "kvindex_proxy_token_mismatch_models") == {"": 1.0}
    log = (tmp_path / "proxy.log").read_text()
    lines = [line for line in log.splitlines() if "token-count mismatch" in line]
    print(f"logged: {lines}")
    assert len(lines) == 1 and "counts" in lines[0] and "(routed to r2)" in lines[0]


def _sim(stack: ExitStack, workdir: Path, rid: str, extra: list[str]) -> tuple[Child, str]:
    """A replica-sim started as ``_start`` starts them, and its ``--replica`` spec."""
    http_port, events = free_port(), f"tcp://127.0.0.1:{free_port()}"
    args = [
        "replica-sim", "--id", rid, "--model", MODEL, "--port", str(http_port),
        "--events", events, "--bind-events", "--replay", "", "--speed", "1000",
        "--seed", "7", *extra,
    ]  # fmt: skip
    child = kvindex_child(f"sim {rid}", args, workdir / f"{rid}.log", http_ok(http_port, "/health"))
    stack.callback(child.stop)
    child.spawn()
    return child, f"id={rid},model={MODEL},url=http://127.0.0.1:{http_port},events={events}"


@pytest.mark.redis_server
def test_on_redis_the_ask_to_clear_reaches_the_indexer(
    stack: ExitStack, tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """The proxy on the Redis store, the indexer another process: r2's verdict is carried
    through Redis, and the indexer drops r2's blocks (its stream reads partial, so said)."""
    small = ["--capacity-blocks", "16"]
    started = [_sim(stack, tmp_path, "r1", small)]
    started.append(_sim(stack, tmp_path, "r2", [*small, "--lie", "drop-removals"]))
    for child, _ in started:
        child.wait_ready(40)
    store = ["--store", "redis", "--redis-url", redis_server.url]
    args = ["indexer", *store, "--status-port", "-1", "--stats-every", "0"]
    for _, spec in started:
        args += ["--replica", spec]
    indexer = kvindex_child("indexer", args, tmp_path / "indexer.log", lambda: True)
    stack.callback(indexer.stop)
    indexer.spawn()
    port = free_port()
    proxy = kvindex_child(
        "proxy", ["proxy", "--port", str(port), *store], tmp_path / "proxy.log",
        http_ok(port, "/readyz"),
    )  # fmt: skip
    stack.callback(proxy.stop)
    proxy.start(40)
    rng = random.Random(29)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=30) as http:
        found_at = _until_verdict(http, "r2", range(20), rng)
        print(f"redis: over-predicted verdict after {found_at} requests: {_view(http, 'r2')}")
        print(f"redis: r2's blocks dropped {_until_cleared(http, 'r2'):.2f} s after")
    assert redis_client.hexists(Schema().clear_asks, "r2")  # tests import the same names
