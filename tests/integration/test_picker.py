"""``kvindex picker`` as a gateway drives it: a gRPC client built from Envoy's ext_proc protos
(:mod:`tests.support.gateway`) replays a gateway's message sequences against the picker (a
subprocess, memory store, its own subscriber) in front of three ``kvindex replica-sim``s; the
test forwards each request to the endpoint named, as the gateway would.

The GIE conformance tests each test mirrors are named in its docstring (their ``ShortName``
in gateway-api-inference-extension's ``conformance/tests``)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvindex.api.load.store import RedisLoadStore
from kvindex.indexer.redis.schema import Schema
from tests.integration.test_proxy import MODEL, Sim
from tests.support.gateway import (
    FULL_DUPLEX,
    STREAMED,
    Gateway,
    Picked,
    body_messages,
    headers_message,
    response_headers_message,
)
from tests.support.processes import Child, http_ok, kvindex_child
from tests.support.redis_server import RedisServer, free_ports
from tests.support.request_logs import text
from tests.support.tokenizer_kinds import write_model

pytestmark = pytest.mark.timeout(90)
CONFIG = """
[api]
health_check_interval_s = 0.2
health_check_timeout_s = 0.2
max_body_bytes = 65536
"""


@dataclass
class Fleet:
    sims: dict[str, Sim]
    picker: Child
    port: int
    metrics_port: int
    gateway: Gateway

    def endpoint(self, rid: str) -> str:
        return f"127.0.0.1:{self.sims[rid].http_port}"

    def replica(self, endpoint: str) -> str:
        (found,) = [rid for rid in self.sims if self.endpoint(rid) == endpoint]
        return found

    def metric(self, name: str, **labels: str) -> float:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = httpx.get(url, trust_env=False, timeout=10).text
        wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        head = f"{name}{{{wanted}}} " if labels else f"{name} "
        lines = [line for line in text.splitlines() if line.startswith(head)]
        return float(lines[0].split()[-1]) if lines else 0.0

    def in_flight(self) -> float:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = httpx.get(url, trust_env=False, timeout=10).text
        lines = [s for s in text.splitlines() if s.startswith("kvindex_picker_in_flight{")]
        return sum(float(line.split()[-1]) for line in lines)


def _sim(rid: str, workdir: Path, http_port: int, events_port: int, *more: str) -> Sim:
    args = [
        "replica-sim", "--id", rid, "--model", MODEL, "--port", str(http_port),
        "--events", f"tcp://127.0.0.1:{events_port}", "--bind-events", "--replay", "",
        "--speed", "1000", "--seed", "7", *more,
    ]  # fmt: skip
    child = kvindex_child(f"sim {rid}", args, workdir / f"{rid}.log", http_ok(http_port, "/health"))
    return Sim(rid, child, http_port, events_port)


@contextmanager
def _running(tmp_path: Path, *store: str, tokenizer: Path | None = None) -> Iterator[Fleet]:
    """Three replica-sims and a picker on ``store`` (memory unless given), stopped after;
    ``tokenizer``: a ``tokenizer.json`` the sims and the picker both tokenize with."""
    config = tmp_path / "kvindex.toml"
    config.write_text(
        CONFIG
        if tokenizer is None
        else CONFIG + f'\n[[models]]\nname = "{MODEL}"\ntokenizer = "{tokenizer}"\n'
    )
    more = () if tokenizer is None else ("--tokenizer", str(tokenizer))
    ports = free_ports(8)
    with ExitStack() as stack:
        sims = {
            rid: _sim(rid, tmp_path, ports[2 * n], ports[2 * n + 1], *more)
            for n, rid in enumerate(("r1", "r2", "r3"))
        }
        for sim in sims.values():
            stack.callback(sim.child.stop)
            sim.child.spawn()
        for sim in sims.values():
            sim.child.wait_ready(40)
        replicas = [arg for sim in sims.values() for arg in ("--replica", sim.spec)]
        if store:
            args = ["indexer", *store, "--status-port", "-1", "--stats-every", "0", *replicas]
            indexer = kvindex_child("indexer", args, tmp_path / "indexer.log", lambda: True)
            stack.callback(indexer.stop)
            indexer.spawn()
        port, metrics_port = ports[6], ports[7]
        args = ["picker", "--config", str(config), "--port", str(port)]
        args += ["--metrics-port", str(metrics_port), *store, *replicas]
        log = tmp_path / "picker.log"
        picker = kvindex_child("picker", args, log, http_ok(metrics_port, "/readyz"))
        stack.callback(picker.stop)
        picker.start(40)
        gateway = Gateway(port)
        stack.callback(gateway.close)
        yield Fleet(sims, picker, port, metrics_port, gateway)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with _running(tmp_path) as running:
        yield running


def _chat(topic: str) -> dict[str, Any]:
    words = " ".join(f"{topic}{i}" for i in range(60))
    messages = [
        {"role": "system", "content": f"You answer questions about {topic}."},
        {"role": "user", "content": words},
    ]
    return {"model": MODEL, "messages": messages, "max_tokens": 2}


def _forward(fleet: Fleet, endpoint: str, body: dict[str, Any]) -> int:
    """Send ``body`` to ``endpoint`` as the gateway would; the prompt tokens it had cached."""
    url = f"http://{endpoint}/v1/chat/completions"
    answer = httpx.post(url, json=body, trust_env=False, timeout=20)
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def _route(fleet: Fleet, body: dict[str, Any], **pick: Any) -> tuple[str, int]:
    """One whole request through the gateway: (the primary endpoint, tokens it had cached)."""
    stream, picked = fleet.gateway.pick(body, **pick)
    assert picked.header is not None, picked.answers
    primary = picked.endpoints[0]
    cached = _forward(fleet, primary, body)
    fleet.gateway.finish(stream)
    return primary, cached


def _named(fleet: Fleet, body: dict[str, Any]) -> bool:
    """Endpoints were named for ``body`` (the stream then closed, its request abandoned)."""
    stream, picked = fleet.gateway.pick(body)
    stream.half_close()
    return picked.header is not None


def _primary(fleet: Fleet, body: dict[str, Any]) -> str:
    """The endpoint named first for ``body`` (the stream then closed, its request abandoned)."""
    stream, picked = fleet.gateway.pick(body)
    stream.half_close()
    return picked.endpoints[0]


def _until(condition: Callable[[], object], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout_s} s")
        time.sleep(0.05)


def test_repeated_prefixes_get_the_replica_that_holds_them(fleet: Fleet) -> None:
    """Mirrors GatewayFollowingEPPRouting: the endpoint named is the one a gateway sends to,
    and kvindex names the replica holding the prompt's prefix."""
    for topic in ("apples", "boats", "clouds"):
        body = _chat(topic)
        first, cached = _route(fleet, body)
        assert cached == 0
        holders = {first}
        for _ in range(40):  # until the picker's index has heard of the first answer's blocks
            endpoint, cached = _route(fleet, body)
            holders.add(endpoint)
            if cached:
                break
        assert len(holders) <= 2, holders  # one routed on load before the events arrived
        repeats = [_route(fleet, body) for _ in range(4)]
        assert all(cached > 0 for _, cached in repeats), repeats


def test_header_and_metadata_agree_fallbacks_listed_and_the_body_passed_on(
    fleet: Fleet,
) -> None:
    """Mirrors GatewayFollowingEPPRouting (the primary and its fallbacks, in order) and the
    protocol's rule that header and metadata never differ; in full-duplex mode the body comes
    back whole (what a gateway forwards)."""
    body = _chat("kites")
    stream, picked = fleet.gateway.pick(body, num_chunks=4)
    assert picked.header == picked.metadata
    endpoints = picked.endpoints
    assert sorted(endpoints) == sorted(fleet.endpoint(r) for r in fleet.sims)
    assert picked.body_sent_back() == json.dumps(body).encode()
    assert [a.WhichOneof("response") for a in picked.answers] == [
        "request_headers",
        "request_body",
    ]
    answers = fleet.gateway.finish(stream)
    assert [a.WhichOneof("response") for a in answers] == ["response_headers"] + 2 * [
        "response_body"
    ]
    sent_back = [a.response_body.response.body_mutation.streamed_response for a in answers[1:]]
    assert [s.end_of_stream for s in sent_back] == [False, True]


def test_streamed_mode_passes_each_chunk_on(fleet: Fleet) -> None:
    """The streamed body mode (the gateway sends the body without waiting for the headers'
    answer): the headers' answer names the endpoints, then one answer per chunk, unchanged."""
    stream, picked = fleet.gateway.pick(_chat("reeds"), num_chunks=3, mode=STREAMED)
    kinds = [a.WhichOneof("response") for a in picked.answers]
    assert kinds == ["request_headers"] + 3 * ["request_body"]
    assert picked.header == picked.metadata and len(picked.endpoints) == 3
    assert not any(a.request_body.HasField("response") for a in picked.answers[1:])
    fleet.gateway.finish(stream)
    _until(lambda: fleet.in_flight() == 0, 10)


def test_a_subset_hint_is_obeyed(fleet: Fleet) -> None:
    """Mirrors GatewayFollowingEPPRouting's subsets (one pod, two pods, all): the endpoints
    named are the subset's, and 503 when none of it serves (the protocol's subset rule)."""
    body = _chat("dunes")
    for subset in (["r2"], ["r1", "r3"], ["r1", "r2", "r3"]):
        hint = [fleet.endpoint(r) for r in subset]
        for _ in range(3):
            stream, picked = fleet.gateway.pick(body, subset=hint)
            assert set(picked.endpoints) == set(hint), (subset, picked.endpoints)
            fleet.gateway.finish(stream)
    for hint in (["10.0.0.1:8000"], []):
        stream, picked = fleet.gateway.pick(body, subset=hint)
        assert picked.immediate_status == 503 and picked.header is None
        assert stream.ended()
    assert fleet.metric("kvindex_picker_subset_misses_total") == 2.0


def test_data_parallel_ranks_are_ports_of_one_address(fleet: Fleet) -> None:
    """Mirrors GatewayFollowingEPPRoutingWithDataParallelism: replicas on one IP are told
    apart by port, and a subset naming one port of that IP is kept to it."""
    stream, picked = fleet.gateway.pick(_chat("ranks"))
    hosts = {e.rsplit(":", 1)[0] for e in picked.endpoints}
    ports = {e.rsplit(":", 1)[1] for e in picked.endpoints}
    assert hosts == {"127.0.0.1"} and len(ports) == 3
    fleet.gateway.finish(stream)
    one_rank = [fleet.endpoint("r3")]
    for _ in range(3):
        stream, picked = fleet.gateway.pick(_chat("ranks"), subset=one_rank)
        assert picked.endpoints == one_rank
        fleet.gateway.finish(stream)


def test_reservations_back_to_zero_after_ends_resets_and_cancels(fleet: Fleet) -> None:
    """Every request the picker chose for stops counting once: at the response's end, when
    the gateway closes the stream before it (a reset), and when it cancels the call; the
    served endpoint the gateway reports (GatewayDestinationEndpointServed) moves it."""
    stream, picked = fleet.gateway.pick(_chat("ends"))
    assert fleet.in_flight() == 1
    fleet.gateway.finish(stream, served=picked.endpoints[1])
    _until(lambda: fleet.in_flight() == 0, 10)
    assert fleet.metric("kvindex_picker_served_elsewhere_total") == 1.0
    stream, _ = fleet.gateway.pick(_chat("resets"))
    assert fleet.in_flight() == 1
    stream.half_close()
    _until(lambda: fleet.in_flight() == 0, 10)
    stream, _ = fleet.gateway.pick(_chat("cancels"))
    assert fleet.in_flight() == 1
    stream.cancel()
    _until(lambda: fleet.in_flight() == 0, 10)
    released = "kvindex_picker_reservations_released_total"
    assert fleet.metric(released, reason="abandoned") == 2.0
    assert fleet.metric(released, reason="done") == 2.0  # the move released one first


def test_malformed_requests_get_a_clear_4xx(fleet: Fleet) -> None:
    """Not JSON, not an object, no model, an unknown model, a body past the bound, messages
    out of order: an ImmediateResponse each, the picker still serving after."""
    cases: list[tuple[bytes | dict[str, Any], int]] = [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        ({"messages": []}, 400),
        ({"model": "nope", "prompt": "a"}, 404),
        ({"model": MODEL, "prompt": "x" * 70_000}, 413),
        (b"[" * 100 + b"]" * 100, 400),
    ]
    for body, status in cases:
        stream, picked = fleet.gateway.pick(body)
        assert picked.immediate_status == status, (body, picked.answers)
        assert stream.ended()
    stream = fleet.gateway.open()
    stream.send(*body_messages(b"{}", 1))  # a body before any headers
    (answer,) = stream.answers(1)
    assert answer.immediate_response.status.code == 400
    stream = fleet.gateway.open()
    headers = {":method": "POST", ":path": "/v1/completions"}
    stream.send(headers_message(headers, mode=FULL_DUPLEX), response_headers_message())
    (answer,) = stream.answers(1)
    assert answer.immediate_response.status.code == 400
    assert fleet.metric("kvindex_picker_decisions_total", outcome="bad_request") == 6.0
    assert fleet.metric("kvindex_picker_decisions_total", outcome="too_large") == 1.0
    _route(fleet, _chat("after"))  # still serving


def test_a_request_without_body_is_routed_on_load(fleet: Fleet) -> None:
    """A GET (headers with end of stream): endpoints named at once, on the headers' answer."""
    stream = fleet.gateway.open()
    headers = {":method": "GET", ":path": "/v1/models"}
    stream.send(headers_message(headers, end_of_stream=True))
    picked = Picked(stream.answers(1))
    assert picked.header == picked.metadata and len(picked.endpoints) == 3
    stream.send(response_headers_message())
    stream.send()
    stream.half_close()
    _until(lambda: fleet.in_flight() == 0, 10)


def test_grpc_health_and_503_when_every_endpoint_is_down(fleet: Fleet) -> None:
    """The gRPC health service answers SERVING (the protocol's health checking); with every
    replica down (ejected by its failed health checks) a request is answered 503."""
    stub = health_pb2_grpc.HealthStub(fleet.gateway.channel)
    for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
        answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    for sim in fleet.sims.values():
        sim.child.stop()

    def refused() -> bool:
        _stream, picked = fleet.gateway.pick(_chat("down"))
        return picked.immediate_status == 503

    _until(refused, 15)
    assert fleet.metric("kvindex_picker_decisions_total", outcome="no_endpoint") >= 1.0


def test_the_grpc_port_refuses_no_connection_after_a_bad_stream(fleet: Fleet) -> None:
    """A stream the gateway abandons mid-body leaves the picker serving the next."""
    stream = fleet.gateway.open()
    stream.send(headers_message({":method": "POST"}), *body_messages(b'{"model": "', 2)[:1])
    stream.cancel()
    with pytest.raises(grpc.RpcError):
        stream.answers(1)
    _route(fleet, _chat("next"))


@pytest.mark.redis_server
def test_on_redis_the_load_store_every_reader_shares_counts_the_request(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """With ``--store redis`` the request in flight is in the load store the proxy and
    ``/score`` read, from the pick to the response's end."""
    store = RedisLoadStore(redis_server.client(), Schema())

    def in_flight() -> dict[str, int]:
        counted = store.get_counted(["r1", "r2", "r3"])
        return {r: c.in_flight.num_requests for r, c in counted.items() if c.in_flight.num_requests}

    with _running(tmp_path, "--store", "redis", "--redis-url", redis_server.url) as fleet:
        _until(lambda: _named(fleet, _chat("warm")), 20)  # the indexer put the fleet in Redis
        _until(lambda: in_flight() == {}, 10)
        stream, picked = fleet.gateway.pick(_chat("shared"))
        assert in_flight() == {fleet.replica(picked.endpoints[0]): 1}
        fleet.gateway.finish(stream)
        _until(lambda: in_flight() == {}, 10)


def _long_chat(seed: int) -> dict[str, Any]:
    body = _chat(f"heads{seed}")
    body["messages"][0]["content"] = text(random.Random(seed), 600)
    return body


def test_a_long_prompt_no_replica_holds_is_chosen_for_on_its_head(tmp_path: Path) -> None:
    """With a local tokenizer, a long never-seen chat is chosen for once its head is
    tokenized; its rest, tokenized after the answer, is kept: the same chat again is not
    chosen for on a head, and goes to the replica that now holds it."""
    tokenizer = write_model(tmp_path / "model", "byte_level_bpe")
    body = _long_chat(5)
    with _running(tmp_path, tokenizer=tokenizer) as fleet:
        first, cached = _route(fleet, body)
        assert cached == 0
        assert fleet.metric("kvindex_picker_head_decisions_total") == 1
        for _ in range(40):  # until the picker has heard of the first answer's blocks
            again, cached = _route(fleet, body)
            if cached:
                break
        assert (again, cached > 0) == (first, True)
        assert fleet.metric("kvindex_picker_head_decisions_total") == 1
        assert fleet.metric("kvindex_picker_head_rest_failures_total") == 0
        _until(lambda: fleet.in_flight() == 0, 5)


def test_a_prompt_a_replica_holds_but_the_picker_never_saw_goes_to_that_replica(
    tmp_path: Path,
) -> None:
    """The head finds its start held, so the whole prompt is tokenized and decides."""
    tokenizer = write_model(tmp_path / "model", "byte_level_bpe")
    body = _long_chat(6)
    with _running(tmp_path, tokenizer=tokenizer) as fleet:
        holder = fleet.endpoint("r2")
        assert _forward(fleet, holder, body) == 0  # sent to r2 past the picker
        # Each pick counts as load on its replica: on load alone three would not agree.
        _until(lambda: {_primary(fleet, body) for _ in range(3)} == {holder}, 10)
        assert _route(fleet, body)[1] > 0
        assert fleet.metric("kvindex_picker_head_decisions_total") == 0  # the whole decided
