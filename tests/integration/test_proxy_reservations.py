"""Requests in flight, reserved by real ``kvindex proxy`` processes in one real Redis (which
one indexer fills from three ``kvindex replica-sim``s): released when a client goes away,
counted by every proxy, and freed after the lease TTL when a proxy is killed (SIGKILL);
and one proxy alone on the memory store, whose simultaneous choices see each other.

The proxies scrape no load (``[api] scrape_interval_s = 0``), so the requests in flight
their peers reserved are the only load they can see: a replica chosen for being idle was
chosen on them. The replica-sims answer slowly (a request takes seconds), so requests stay
in flight long enough to be looked at."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from kvindex.api.load.model import InFlight
from kvindex.api.load.store import RedisLoadStore
from kvindex.indexer.redis.schema import Schema
from tests.integration.test_proxy import MODEL, Sim
from tests.support.processes import Child, http_ok, kvindex_child
from tests.support.redis_server import RedisServer, free_port

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis_server]
LEASE_TTL_S = 2.0
REPLICAS = ("r1", "r2", "r3")
SLOW_TOKENS = 150
"""Output tokens of a slow request: 7.5 s at the replica-sims' 20 tokens/s."""


SLOW_SIM = ("--decode-tps", "20")
"""A replica-sim that takes seconds to answer (its whole answer, then every chunk at once)."""
STALLING_SIM = ("--stream-stall-s", "60")
"""A replica-sim that answers at once, then stalls its stream after the first chunk."""


def _slow_sim(rid: str, workdir: Path, behaviour: tuple[str, ...] = SLOW_SIM) -> Sim:
    http_port, events_port = free_port(), free_port()
    args = [
        "replica-sim", "--id", rid, "--model", MODEL, "--port", str(http_port),
        "--events", f"tcp://127.0.0.1:{events_port}", "--bind-events", "--replay", "",
        "--seed", "7", *behaviour,
    ]  # fmt: skip
    child = kvindex_child(f"sim {rid}", args, workdir / f"{rid}.log", http_ok(http_port, "/health"))
    return Sim(rid, child, http_port, events_port)


@dataclass
class Fleet:
    proxies: list[Child]
    ports: list[int]
    store: RedisLoadStore
    """The load store the proxies share, read as ``/score`` reads it."""

    def url(self, number: int, path: str) -> str:
        return f"http://127.0.0.1:{self.ports[number]}{path}"

    def in_flight(self) -> dict[str, InFlight]:
        counted = self.store.get_counted(["r1", "r2", "r3"])
        return {r: c.in_flight for r, c in counted.items() if c.in_flight.num_requests}

    def metric(self, number: int, name: str, **labels: str) -> float:
        """A sample of proxy ``number``'s /metrics (0 when absent)."""
        return _metric(self.ports[number], name, **labels)


def _metric(port: int, name: str, **labels: str) -> float:
    """A sample of the /metrics on ``port`` (0 when absent)."""
    url = f"http://127.0.0.1:{port}/metrics"
    text = httpx.get(url, trust_env=False, timeout=10).text
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    head = f"{name}{{{wanted}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(head):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture
def fleet(redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path) -> Iterator[Fleet]:
    with _running_fleet(redis_server, tmp_path, SLOW_SIM) as running:
        yield running


@pytest.fixture
def stalling_fleet(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> Iterator[Fleet]:
    with _running_fleet(redis_server, tmp_path, STALLING_SIM) as running:
        yield running


@contextmanager
def _running_fleet(
    redis_server: RedisServer, tmp_path: Path, behaviour: tuple[str, ...]
) -> Iterator[Fleet]:
    """Three replica-sims, an indexer and two proxies on ``redis_server``, stopped after."""
    config = tmp_path / "kvindex.toml"
    config.write_text("[api]\nscrape_interval_s = 0\n")
    with ExitStack() as stack:
        sims = [_slow_sim(rid, tmp_path, behaviour) for rid in ("r1", "r2", "r3")]
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
        ports = [free_port(), free_port()]
        proxies = []
        for number, port in enumerate(ports):
            command = ["proxy", "--config", str(config), "--port", str(port), "--store", "redis"]
            command += ["--redis-url", redis_server.url, "--lease-ttl-s", str(LEASE_TTL_S)]
            log = tmp_path / f"proxy{number}.log"
            proxy = kvindex_child(f"proxy {number}", command, log, http_ok(port, "/readyz"))
            stack.callback(proxy.stop)
            proxy.start(40)
            proxies.append(proxy)
        _until(lambda: httpx.get(f"http://127.0.0.1:{ports[1]}/v1/models").json()["data"], 20)
        yield Fleet(proxies, ports, RedisLoadStore(redis_server.client(), Schema()))


def _until(condition: Callable[[], object], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout_s} s")
        time.sleep(0.05)


def _body(topic: str, max_tokens: int, *, stream: bool = False) -> dict[str, object]:
    """A prompt of its own (no replica holds it), answered in ``max_tokens`` words."""
    prompt = " ".join(f"{topic}{i}" for i in range(40))
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


class SlowClient:
    """A streaming request on a socket of its own; :meth:`close` goes away before the
    answer ends (the socket closed: the proxy sees the client gone at once)."""

    def __init__(self, port: int, topic: str) -> None:
        body = json.dumps(_body(topic, SLOW_TOKENS, stream=True)).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(head.encode() + body)

    def first_chunk(self) -> bytes:
        """What came until the answer's first server-sent event (the stream has begun)."""
        received = b""
        while b"data: " not in received:
            data = self.sock.recv(65536)
            if not data:
                raise AssertionError(f"the answer ended before its first event: {received!r}")
            received += data
        return received

    def close(self) -> None:
        self.sock.close()


def _slow(fleet: Fleet, number: int, topic: str) -> SlowClient:
    return SlowClient(fleet.ports[number], topic)


def test_a_client_that_goes_away_releases_its_reservation(fleet: Fleet) -> None:
    client = _slow(fleet, 0, "kites")
    _until(lambda: sum(f.num_requests for f in fleet.in_flight().values()) == 1, 20)
    ((replica, in_flight),) = fleet.in_flight().items()
    assert in_flight.num_tokens > 0  # the prompt is cached nowhere: all of it is prefill
    assert fleet.metric(0, "kvindex_proxy_in_flight", replica=replica) == 1.0
    client.close()  # before the answer is done
    _until(lambda: fleet.in_flight() == {}, 20)
    assert fleet.metric(0, "kvindex_proxy_in_flight", replica=replica) == 0.0
    released = "kvindex_proxy_reservations_released_total"
    assert fleet.metric(0, released, reason="disconnect") == 1.0
    assert fleet.metric(0, released, reason="done") == 0.0


def test_a_client_that_leaves_mid_stream_releases_its_reservation(stalling_fleet: Fleet) -> None:
    fleet = stalling_fleet
    client = _slow(fleet, 0, "gulls")
    assert b" 200 OK" in client.first_chunk()  # streaming: the answer's head and first event
    ((replica, in_flight),) = fleet.in_flight().items()
    assert in_flight.num_requests == 1
    assert fleet.metric(0, "kvindex_proxy_in_flight", replica=replica) == 1.0
    client.close()  # mid-stream: the replica stalls for a minute after its first event
    _until(lambda: fleet.in_flight() == {}, 20)  # in the load store every process reads
    assert fleet.metric(0, "kvindex_proxy_in_flight", replica=replica) == 0.0
    released = "kvindex_proxy_reservations_released_total"
    assert fleet.metric(0, released, reason="disconnect") == 1.0
    assert fleet.metric(0, released, reason="done") == 0.0


def test_two_proxies_see_each_others_requests_in_flight(fleet: Fleet) -> None:
    clients = [_slow(fleet, 0, "oak")]
    try:
        # One after the other: a reservation counts in every choice made after it (two
        # choices at the same instant may miss each other, see api.load.reservations).
        _until(lambda: len(fleet.in_flight()) == 1, 20)
        clients.append(_slow(fleet, 0, "elm"))
        _until(lambda: len(fleet.in_flight()) == 2, 20)  # elsewhere: the first was seen
        busy = set(fleet.in_flight())
        (idle,) = {"r1", "r2", "r3"} - busy
        with httpx.Client(trust_env=False, timeout=30) as http:
            for topic in ("ash", "yew", "fir"):
                answer = http.post(fleet.url(1, "/v1/completions"), json=_body(topic, 1))
                assert answer.status_code == 200
                assert answer.headers["x-kvindex-replica"] == idle, (topic, busy)
        released = "kvindex_proxy_reservations_released_total"
        _until(lambda: fleet.metric(1, released, reason="done") == 3.0, 10)  # after last byte
        assert fleet.metric(1, "kvindex_proxy_in_flight", replica=idle) == 0.0
        assert set(fleet.in_flight()) == busy  # the first proxy's, still streaming
    finally:
        for client in clients:
            client.close()


def test_a_killed_proxy_leaks_nothing_past_its_lease(fleet: Fleet) -> None:
    clients = [_slow(fleet, 0, topic) for topic in ("reef", "cove")]
    try:
        _until(lambda: sum(f.num_requests for f in fleet.in_flight().values()) == 2, 20)
        fleet.proxies[0].kill()  # SIGKILL: no release, no goodbye
        killed_at = time.monotonic()
        assert sum(f.num_requests for f in fleet.in_flight().values()) == 2  # the lease lives
        _until(lambda: fleet.in_flight() == {}, LEASE_TTL_S + 10)
        assert time.monotonic() - killed_at >= LEASE_TTL_S / 3  # freed by the lease, no sooner
        with httpx.Client(trust_env=False, timeout=30) as http:  # the other proxy serves on
            answer = http.post(fleet.url(1, "/v1/completions"), json=_body("tide", 1))
            assert answer.status_code == 200
        _until(lambda: fleet.in_flight() == {}, 10)  # released once its last byte was sent
    finally:
        for client in clients:
            client.close()


def test_one_proxy_on_the_memory_store_spreads_simultaneous_requests(tmp_path: Path) -> None:
    """Alone on the memory store, reading, choosing and reserving are one step: three
    requests sent at once (their prompts cached nowhere, no load scraped) go to three
    replicas, each choice seeing the ones before it."""
    config = tmp_path / "kvindex.toml"
    config.write_text("[api]\nscrape_interval_s = 0\n")
    with ExitStack() as stack:
        sims = [_slow_sim(rid, tmp_path) for rid in ("r1", "r2", "r3")]
        for sim in sims:
            stack.callback(sim.child.stop)
            sim.child.spawn()
        for sim in sims:
            sim.child.wait_ready(40)
        port = free_port()
        args = ["proxy", "--config", str(config), "--port", str(port)]
        for sim in sims:
            args += ["--replica", sim.spec]
        proxy = kvindex_child("proxy", args, tmp_path / "proxy.log", http_ok(port, "/readyz"))
        stack.callback(proxy.stop)
        proxy.start(40)
        clients = [SlowClient(port, topic) for topic in ("gull", "tern", "skua")]
        for client in clients:
            stack.callback(client.close)

        def in_flight() -> list[float]:
            return [_metric(port, "kvindex_proxy_in_flight", replica=r) for r in REPLICAS]

        _until(lambda: sum(in_flight()) == 3, 20)
        assert in_flight() == [1.0, 1.0, 1.0]
