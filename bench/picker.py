"""``kvindex picker``'s decision latency: from a gateway's request headers sent to the header
mutation naming the endpoints received, for an ~8,000-token chat body tokenized in the picker
by a local tokenizer (a byte-level BPE ``tokenizer.json`` trained here, with a ChatML template
whose turn markers are special tokens, as a chat model's are).

Three ``kvindex replica-sim``s and one ``kvindex picker`` (memory store, its own subscriber)
run as subprocesses on free loopback ports; a gateway stand-in built from Envoy's ext_proc
protos (the messages of ``tests/support/gateway.py``, sent by an asyncio gRPC client, each
write awaited) sends each request on its own ``Process`` stream: the headers, the body in 4
chunks (full-duplex streamed), then the response to its end. The replica-sims tokenize by
words, not with this tokenizer, so their KV events match no prompt here: the latency is a
decision's cost, not a cache hit's. ``small`` sends a one-word prompt (the floor: gRPC and a
decision with nothing to tokenize); ``repeat`` sends one body again and again (after the first,
the picker's tokenizer cache answers, as for a fleet's recurring prompts); ``unique`` gives
each request a body never sent (tokenized in full each time); ``turns`` makes each request a
conversation's next turn (the last one's messages, an assistant answer and a new user question:
what a gateway mostly sends), ``--conversations`` of them in turn, their first turns sent
unmeasured before (the tokenizer encodes the new turn only, from the kept prefix). One JSON
line per mode (client-side p50/p90/p99, ``after_body_p50_ms``: from the body's last chunk
written to the header mutation received, the picker's own mean from its
``kvindex_picker_decision_seconds``, ``picker_cpu_ms``: its process's CPU a request,
``gateway_p50_ms``: the requests of the same kind (bodies of their own) from a client that
writes each phase's messages at once over plain HTTP/2, as Envoy does, and
``in_process_p50_ms``: the same request phase fed to a picker built in the bench's process, no
gRPC, each phase settled as the servicer settles it; ``in_process_whole_first_p50_ms``: the
same with ``[picker] head_first = false``), then ``unique_start_held`` (in process: each
``unique`` body's first 64 blocks held by a replica first, so a head finds its start held and
the whole decides), then one with the machine's load.

    python bench/picker.py [--requests 300] [--prompt-tokens 8000] [--conversations 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import httpx
import tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from machine import calibration_ms, host_load

from kvindex.api.config.settings import load_api_settings
from kvindex.api.http.server import Service
from kvindex.api.tokenize.local import LocalTokenizer
from kvindex.clients.picker.service import Picker, build_picker
from kvindex.clients.picker.settings import PickerSettings
from kvindex.indexer.config.settings import load_settings
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.domain.keys import chain_keys, model_root
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.protocol import OpKind
from tests.support.gateway import (
    body_messages,
    headers_message,
    response_body_message,
    response_headers_message,
)
from tests.support.processes import Child, http_ok, kvindex_child
from tests.support.redis_server import free_ports
from tests.support.request_logs import text
from tests.support.tokenizer_kinds import write_model

MODEL = "demo-model"
STORE, GPU = OpKind.STORE, Tier.GPU
REQUEST_HEADERS = {":method": "POST", ":path": "/v1/chat/completions"}
HELD_BLOCKS = 64
"""``unique_start_held``: the blocks of each body's start a replica holds (1,024 tokens)."""
TURN_WORDS = (60, 30)
"""An assistant answer's and a user question's words in each next turn."""


def _tokenizer(workdir: Path) -> Path:
    return write_model(workdir / "model", "byte_level_bpe")


def _chat(tokenizer_path: Path, num_tokens: int, seed: int) -> dict[str, Any]:
    """A system prompt and a question, ~``num_tokens`` tokens in all by this tokenizer."""
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    rng = random.Random(seed)
    words = text(rng, num_tokens)
    per_word = len(tok.encode(words).ids) / num_tokens
    system = text(rng, int(num_tokens / per_word) - 40)
    question = f"request {seed}: " + text(rng, 30)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 1}


def _turns(
    tokenizer_path: Path, num_tokens: int, num_conversations: int, num_turns: int, seed: int = 0
) -> tuple[list[bytes], list[bytes]]:
    """Each conversation's first turn, then its next ``num_turns`` turns, conversations in
    turn; sized to grow through ``num_tokens`` (about 100 tokens a turn)."""
    rng = random.Random(1 + seed)
    chats = [
        _chat(tokenizer_path, num_tokens - 60 * num_turns, 10_000 + 1_000 * seed + n)
        for n in range(num_conversations)
    ]
    first = [json.dumps(chat).encode() for chat in chats]
    later: list[bytes] = []
    for _ in range(num_turns):
        for chat in chats:
            chat["messages"] += [
                {"role": "assistant", "content": text(rng, TURN_WORDS[0])},
                {"role": "user", "content": text(rng, TURN_WORDS[1])},
            ]
            later.append(json.dumps(chat).encode())
    return first, later


def _fleet(stack: ExitStack, workdir: Path, tokenizer: Path) -> tuple[int, int, int]:
    """Three sims and a picker; the picker's gRPC and metrics ports and its process id."""
    ports = free_ports(8)
    specs = []
    for n, rid in enumerate(("r1", "r2", "r3")):
        http_port, events = ports[2 * n], f"tcp://127.0.0.1:{ports[2 * n + 1]}"
        args = [
            "replica-sim", "--id", rid, "--model", MODEL, "--port", str(http_port),
            "--events", events, "--bind-events", "--replay", "", "--speed", "1000000",
        ]  # fmt: skip
        sim = kvindex_child(rid, args, workdir / f"{rid}.log", http_ok(http_port, "/health"))
        stack.callback(sim.stop)
        sim.start(40)
        specs.append(f"id={rid},model={MODEL},url=http://127.0.0.1:{http_port},events={events}")
    config = workdir / "kvindex.toml"
    config.write_text(f'[[models]]\nname = "{MODEL}"\ntokenizer = "{tokenizer}"\n')
    port, metrics_port = ports[6], ports[7]
    args = ["picker", "--config", str(config), "--port", str(port)]
    args += ["--metrics-port", str(metrics_port)]
    for spec in specs:
        args += ["--replica", spec]
    picker: Child = kvindex_child(
        "picker", args, workdir / "picker.log", http_ok(metrics_port, "/readyz")
    )
    stack.callback(picker.stop)
    picker.start(40)
    assert picker.process is not None
    return port, metrics_port, picker.process.pid


def _cpu_s(pid: int) -> float:
    """The CPU seconds (user and system) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _decide(stub: Any, raw: bytes) -> tuple[float, float]:
    """Seconds from the headers sent, and from the body's end written, to the header
    mutation received; the stream finished."""
    call = stub.Process()
    started = time.perf_counter()
    for message in (headers_message(REQUEST_HEADERS), *body_messages(raw, 4)):
        await call.write(message)
    written = time.perf_counter()
    named = await call.read()
    received = time.perf_counter()
    assert named.request_headers.response.header_mutation.set_headers, named
    await call.read()  # the body sent back
    await call.write(response_headers_message())
    await call.write(response_body_message(b"data: [DONE]\n\n", True))
    await call.read()
    await call.read()
    await call.done_writing()
    return received - started, received - written


PROCESS_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


class RawGateway:
    """A gateway's side of ``Process`` streams written as Envoy's C++ client writes them: each
    phase's messages framed and sent in one write over plain HTTP/2 (``h2``), no gRPC library,
    so that no client-side pacing between messages is timed."""

    def __init__(self, port: int) -> None:
        self._sock = socket.create_connection(("127.0.0.1", port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        self._conn = h2.connection.H2Connection(config)
        self._conn.initiate_connection()
        self._conn.increment_flow_control_window(2**30)
        self._flush()
        self._received: dict[int, bytearray] = {}
        self._ended: set[int] = set()

    def close(self) -> None:
        self._sock.close()

    def decide(self, raw: bytes) -> float:
        """Seconds from the request phase written to the header mutation read."""
        stream = self._conn.get_next_available_stream_id()
        self._conn.send_headers(stream, _grpc_headers())
        messages = (headers_message(REQUEST_HEADERS), *body_messages(raw, 4))
        started = time.perf_counter()
        self._send(stream, b"".join(map(_framed, messages)))
        named = self._message(stream)
        elapsed = time.perf_counter() - started
        assert b"x-gateway-destination-endpoint" in named, named
        self._message(stream)  # the body sent back
        response = (response_headers_message(), response_body_message(b"data: [DONE]", True))
        self._send(stream, b"".join(map(_framed, response)), end=True)
        while stream not in self._ended:
            self._read()
        del self._received[stream]
        return elapsed

    def _send(self, stream: int, data: bytes, *, end: bool = False) -> None:
        """``data`` in DATA frames of the largest size allowed, written at once."""
        while self._conn.local_flow_control_window(stream) < len(data):
            self._read()
        size = self._conn.max_outbound_frame_size
        for start in range(0, len(data), size):
            last = start + size >= len(data)
            self._conn.send_data(stream, data[start : start + size], end_stream=end and last)
        self._flush()

    def _message(self, stream: int) -> bytes:
        """The next gRPC message on ``stream`` (its bytes, not parsed)."""
        while True:
            buffer = self._received.setdefault(stream, bytearray())
            if len(buffer) >= 5:
                size = int.from_bytes(buffer[1:5], "big")
                if len(buffer) >= 5 + size:
                    message = bytes(buffer[5 : 5 + size])
                    del buffer[: 5 + size]
                    return message
            self._read()

    def _read(self) -> None:
        data = self._sock.recv(1 << 20)
        if not data:
            raise ConnectionError("the picker closed the connection")
        for event in self._conn.receive_data(data):
            if isinstance(event, h2.events.DataReceived) and event.stream_id is not None:
                self._received.setdefault(event.stream_id, bytearray()).extend(event.data or b"")
                self._conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                assert event.stream_id is not None
                self._ended.add(event.stream_id)
        self._flush()

    def _flush(self) -> None:
        self._sock.sendall(self._conn.data_to_send())


def _grpc_headers() -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", PROCESS_PATH),
        (":authority", "127.0.0.1"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]


def _framed(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return b"\x00" + len(data).to_bytes(4, "big") + data


def _raw_p50_ms(port: int, warm: list[bytes], bodies: list[bytes]) -> dict[str, float]:
    """``gateway_p50_ms``: the same requests from a :class:`RawGateway`."""
    gateway = RawGateway(port)
    try:
        for body in warm:
            gateway.decide(body)
        times = [gateway.decide(body) for body in bodies]
    finally:
        gateway.close()
    return {"gateway_p50_ms": round(statistics.median(times) * 1000, 3)}


def _server_mean_ms(metrics_port: int) -> tuple[float, float]:
    text_ = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", trust_env=False).text
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text_.splitlines()
        if line.startswith("kvindex_picker_decision_seconds_")
    }
    return values["kvindex_picker_decision_seconds_sum"], values[
        "kvindex_picker_decision_seconds_count"
    ]


async def _run(
    port: int, warm: list[bytes], bodies: list[bytes], metrics_port: int, pid: int
) -> dict[str, float]:
    """``warm`` sent first, unmeasured (the connection, the tokenizer, the template); the
    picker's CPU a request from ``/proc``."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        for body in warm:
            await _decide(stub, body)
        before, cpu_before = _server_mean_ms(metrics_port), _cpu_s(pid)
        pairs = [await _decide(stub, body) for body in bodies]
        after, cpu_after = _server_mean_ms(metrics_port), _cpu_s(pid)
    times = [whole for whole, _ in pairs]
    cuts = statistics.quantiles(times, n=100)
    return {
        "p50_ms": round(statistics.median(times) * 1000, 3),
        "p90_ms": round(cuts[89] * 1000, 3),
        "p99_ms": round(cuts[98] * 1000, 3),
        "after_body_p50_ms": round(statistics.median(tail for _, tail in pairs) * 1000, 3),
        "server_mean_ms": round((after[0] - before[0]) / (after[1] - before[1]) * 1000, 3),
        "picker_cpu_ms": round((cpu_after - cpu_before) / len(bodies) * 1000, 3),
    }


def _in_process_picker(tokenizer: Path, head_first: bool = True) -> tuple[Service, Picker]:
    """A picker built here on a memory store (stop the service after)."""
    specs = tuple(
        ReplicaSpec.parse(
            f"id=r{n},model={MODEL},url=http://127.0.0.1:{9 + n},events=tcp://127.0.0.1:{19 + n}"
        )
        for n in range(3)
    )
    api = load_api_settings(
        {"health_check_interval_s": 0, "scrape_interval_s": 0},
        [{"name": MODEL, "tokenizer": str(tokenizer)}],
        env={},
    )
    service = Service.build(load_settings(extra_replicas=specs, env={}), api)
    return service, build_picker(service.deps, PickerSettings(head_first=head_first))


async def _in_process(
    tokenizer: Path, warm: list[bytes], bodies: list[bytes], head_first: bool = True
) -> float:
    """The request phase fed straight to a picker built here (no gRPC, no sockets): what the
    picker's own work costs. Health checks off (no replica runs), the same tokenizer."""
    service, picker = _in_process_picker(tokenizer, head_first)
    try:
        for body in warm:
            await _feed(picker, body)
        times = [await _feed(picker, body) for body in bodies]
    finally:
        service.stop()
    return round(statistics.median(times) * 1000, 3)


async def _feed(picker: Picker, raw: bytes) -> float:
    """One request's phases, each settled as the servicer settles it; the request phase timed."""
    exchange = picker.exchange()
    started = time.perf_counter()
    for message in (headers_message({":method": "POST"}), *body_messages(raw, 4)):
        await exchange.handle(message)
    elapsed = time.perf_counter() - started
    await exchange.settle()
    await exchange.handle(response_headers_message())
    await exchange.handle(response_body_message(b"", True))
    return elapsed


async def _held_start(tokenizer: Path, bodies: list[bytes], head_first: bool) -> float:
    """``unique``'s bodies in process, each one's first :data:`HELD_BLOCKS` blocks held by r0
    first (a shared system prompt's): a head then finds its start held, so the whole decides."""
    service, picker = _in_process_picker(tokenizer, head_first)
    local = LocalTokenizer.from_files(tokenizer, prefix_cache_bytes=0)
    root, stream = model_root(MODEL), StreamId("r0", 0)
    try:
        times = []
        for seq, body in enumerate(bodies):
            packed = await local.packed_messages(json.loads(body)["messages"])
            keys = chain_keys(root, packed[: 4 * 16 * HELD_BLOCKS], 16, None)
            service.deps.index.apply(stream, seq, time.time(), [(STORE, GPU, k, k) for k in keys])
            times.append(await _feed(picker, body))
    finally:
        service.stop()
    return round(statistics.median(times) * 1000, 3)


def _modes(
    tokenizer: Path, args: argparse.Namespace, client: int
) -> list[tuple[str, list[bytes], list[bytes]]]:
    """Each mode's (name, warm-up bodies, measured bodies); ``client`` 1 (the raw gateway's)
    gets bodies of its own where the picker must not have seen client 0's."""
    start = 1 + client * args.requests
    bodies = [
        json.dumps(_chat(tokenizer, args.prompt_tokens, seed)).encode()
        for seed in (0, *range(start, start + args.requests))
    ]
    small = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1}).encode()
    num_turns = max(1, args.requests // args.conversations)
    first, later = _turns(tokenizer, args.prompt_tokens, args.conversations, num_turns, client)
    return [
        ("small", [small] * 20, [small] * args.requests),
        ("repeat", [bodies[0]] * 20, [bodies[0]] * args.requests),
        ("unique", [bodies[0]] * 20, bodies[1:]),
        ("turns", first, later),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--conversations", type=int, default=30)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        tokenizer = _tokenizer(workdir)
        port, metrics_port, pid = _fleet(stack, workdir, tokenizer)
        modes = [_modes(tokenizer, args, client) for client in range(2)]
        for (mode, warm, sent), (_, raw_warm, raw_sent) in zip(*modes, strict=True):
            tokens = 1 if mode == "small" else args.prompt_tokens
            row = {"bench": "picker", "mode": mode, "prompt_tokens": tokens}
            row |= {"body_bytes": round(statistics.mean(map(len, sent))), "requests": len(sent)}
            row |= asyncio.run(_run(port, warm, sent, metrics_port, pid))
            row |= _raw_p50_ms(port, raw_warm, raw_sent)
            row["in_process_p50_ms"] = asyncio.run(_in_process(tokenizer, warm, sent))
            whole = asyncio.run(_in_process(tokenizer, warm, sent, head_first=False))
            row["in_process_whole_first_p50_ms"] = whole
            print(json.dumps(row), flush=True)
            if mode == "unique":
                row = {"bench": "picker", "mode": "unique_start_held", "requests": len(sent)}
                row["in_process_p50_ms"] = asyncio.run(_held_start(tokenizer, sent, True))
                whole = asyncio.run(_held_start(tokenizer, sent, False))
                row["in_process_whole_first_p50_ms"] = whole
                print(json.dumps(row), flush=True)
    print(json.dumps({"bench": "picker", "load": host_load(), "calibration_ms": calibration_ms()}))


if __name__ == "__main__":
    main()
