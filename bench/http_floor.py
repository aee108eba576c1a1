"""HTTP floor benchmark: what the framework and the server add to ``/score``, stack by stack.

Usage (from the repository root)::

    .venv/bin/python bench/http_floor.py                        # every stack, every server
    .venv/bin/python bench/http_floor.py --quick                # a few seconds per stack
    .venv/bin/python bench/http_floor.py --stacks fastapi,lean --servers uvicorn --rounds 3

Each (server, stack) pair runs in a fresh API process on a free loopback port, over the same
memory-store fleet: ``--replicas`` replicas, replica *i* caching the first *i*/``--replicas``
of the measured prompt (``--tokens`` token ids, so every lookup walks a long prefix and every
candidate is scored). Stacks:

* ``fastapi``: the app as ``create_app(..., lean_routes=False)`` builds it: ``/score`` and
  ``/healthz`` through FastAPI's router, dependency (the token check on ``/score``) and
  ``Request``/``Response`` objects.
* ``lean``: the app as served (``create_app``): ``POST /score`` and ``GET /healthz`` answered
  by :class:`~kvindex.api.http.hot_routes.HotRoutes` inside the same middlewares; the rest FastAPI.
  Under uvicorn their plain requests are answered by the server's protocol itself
  (:mod:`kvindex.api.http.server_protocol`), as every kvindex API process serves them; in
  process (no server) by the middleware. The ``fastapi`` and ``bare`` stacks are served
  without that protocol path.
* ``bare``: the floor: a bare ASGI callable that answers ``GET /healthz`` and ``POST /score``
  (the app's body decode, the same ``Scorer``, msgspec encode) with no middleware, no metrics, no
  auth: what any route must cost at least.

Servers: ``uvicorn`` as every kvindex process runs it (``run_app``: httptools with the
request-head deadline, uvloop), ``granian`` (its embedded ASGI server, one runtime thread),
if it is installed (it is not a dependency: ``pip install granian`` to compare), and
``in-process``: no server and no socket, the app called in this process with a ready body,
``health_cpu_us`` and ``score_cpu_us`` its CPU per request (``--requests`` of ``/score``,
four times as many of ``/healthz``): the framework's cost, less exposed to a busy host than
wall-clock latency.

Measured per pair, on raw keep-alive sockets (``score_http.run_load``; bodies encoded once,
warm-up untimed): ``GET /healthz`` at concurrency 1 (the HTTP floor), ``POST /score`` at
concurrency 1 (p50/p99) and at ``--clients`` (q/s), and once more at concurrency 1 with an
``x-forwarded-for`` header (as behind a load balancer: such a request reaches the app).
``--rounds`` repeats every pair, the order of the pairs reversed every other round (so a
drift of the host's load spreads over all).
Output: one JSON line per pair and round on stdout, then one summary line per pair (medians
over the rounds); progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import logging
import socket
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
from score_http import Api, LoadPlan, LoadResult, run_load, running_api

from kvindex.api.config.settings import ApiSettings
from kvindex.api.http.app import create_app
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.runtime import ApiDeps
from kvindex.api.schemas import decode_score_request
from kvindex.api.score import Scorer
from kvindex.indexer.domain.events import BlockStored, EventBatch, StreamId, Tier
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.ingest.ingestor import Ingestor

log = logging.getLogger("kvindex.bench")
MODEL = "bench-model"
BLOCK = 16
STACKS = ("fastapi", "lean", "bare")
SERVERS = ("uvicorn", "granian", "in-process")
_READY_S = 60.0


def main() -> None:
    args = _parser().parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    if args.serve is not None:
        _serve(args.serve[0], args.serve[1], int(args.serve[2]), args)
        return
    pairs = [(v, s) for v in _servers(args.servers) for s in args.stacks.split(",")]
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {p: [] for p in pairs}
    for round_ in range(args.rounds):
        for server, stack in pairs if round_ % 2 == 0 else pairs[::-1]:
            row = _measure(server, stack, args) | {"round": round_}
            rows[server, stack].append(row)
            print(json.dumps(row), flush=True)
    for (server, stack), runs in rows.items():
        print(json.dumps(_summary(server, stack, runs)), flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--stacks", default=",".join(STACKS), help="comma-separated")
    parser.add_argument("--servers", default=",".join(SERVERS), help="comma-separated")
    parser.add_argument("--tokens", type=int, default=8192, help="token ids per /score")
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--clients", type=int, default=8, help="concurrency of the q/s run")
    parser.add_argument("--requests", type=int, default=3000, help="most timed per connection")
    parser.add_argument("--duration-s", type=float, default=4.0, help="longest timed part")
    parser.add_argument("--warmup", type=int, default=200, help="untimed per connection")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="1 s runs, 50 warm-up")
    parser.add_argument("--serve", nargs=3, metavar=("SERVER", "STACK", "PORT"), help="internal")
    return parser


def _servers(names: str) -> list[str]:
    chosen = names.split(",")
    if "granian" in chosen and not _has_granian():
        log.info("granian is not installed: measuring without it (pip install granian)")
        chosen.remove("granian")
    return chosen


def _has_granian() -> bool:
    return importlib.util.find_spec("granian") is not None


# --- the measuring side ---------------------------------------------------------------------


def _measure(server: str, stack: str, args: argparse.Namespace) -> dict[str, Any]:
    if server == "in-process":
        return _measure_in_process(stack, args)
    duration, warmup = (1.0, 50) if args.quick else (args.duration_s, args.warmup)
    one = LoadPlan(1, warmup, args.requests, duration)
    many = LoadPlan(args.clients, warmup, args.requests, duration)
    body = msgspec.json.encode({"model": MODEL, "token_ids": _prompt(args.tokens)})
    with _api(server, stack, args) as api:
        health = run_load(api, _request(api, "GET", "/healthz", b""), one)
        score_request = _request(api, "POST", "/score", body)
        _check(score_request, api, args)
        score_c1 = run_load(api, score_request, one)
        score_cn = run_load(api, score_request, many)
        forwarded = _request(api, "POST", "/score", body, forwarded=True)
        score_fwd = run_load(api, forwarded, one)
    row: dict[str, Any] = {"server": server, "stack": stack, "tokens": args.tokens}
    row |= _latency("health_c1", health) | _latency("score_c1", score_c1)
    row |= _latency("score_forwarded_c1", score_fwd)
    row |= _latency(f"score_c{args.clients}", score_cn)
    row["score_qps_c1"] = round(_qps(score_c1))
    row[f"score_qps_c{args.clients}"] = round(_qps(score_cn))
    log.info("%s", row)
    return row


def _measure_in_process(stack: str, args: argparse.Namespace) -> dict[str, Any]:
    """CPU per request with no server and no socket: the app called with a ready body."""
    num = 500 if args.quick else args.requests
    deps = _deps(args, ApiSettings())
    app = _bare_app(deps) if stack == "bare" else create_app(deps, lean_routes=stack == "lean")
    body = msgspec.json.encode({"model": MODEL, "token_ids": _prompt(args.tokens)})
    health = asyncio.run(_cpu_per_request(app, "GET", "/healthz", b"", num * 4))
    score = asyncio.run(_cpu_per_request(app, "POST", "/score", body, num))
    row = {"server": "in-process", "stack": stack, "tokens": args.tokens}
    row |= {"health_cpu_us": round(health, 1), "score_cpu_us": round(score, 1)}
    log.info("%s", row)
    return row


async def _cpu_per_request(app: Any, method: str, path: str, body: bytes, num: int) -> float:
    """Microseconds of this process's CPU per request (after ``num // 10`` untimed)."""
    headers = [(b"host", b"bench"), (b"content-length", str(len(body)).encode())]
    scope: dict[str, Any] = {"type": "http", "http_version": "1.1", "method": method, "path": path}
    scope |= {"raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http"}
    scope |= {"client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "asgi": {"version": "3.0"}}
    statuses: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    async def one() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        await app(scope | {"headers": headers}, lambda: _pop(messages), send)

    for _ in range(num // 10):
        await one()
    started = time.process_time()
    for _ in range(num):
        await one()
    elapsed = time.process_time() - started
    if set(statuses) != {200}:
        raise RuntimeError(f"{method} {path}: statuses {sorted(set(statuses))}")
    return elapsed / num * 1e6


async def _pop(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return messages.pop() if messages else {"type": "http.disconnect"}


def _check(request: bytes, api: Api, args: argparse.Namespace) -> None:
    """The answer is a real one: every replica scored, the longest holder first."""
    result = run_load(api, request, LoadPlan(1, 0, 1, 10.0))
    answer = json.loads(result.sample_body)
    if result.num_errors or len(answer["scores"]) != args.replicas:
        raise RuntimeError(f"unexpected /score answer: {result.sample_body[:300]!r}")
    if answer["scores"][0]["replica"] != _replica(args.replicas - 1):
        raise RuntimeError(f"the longest holder is not first: {result.sample_body[:300]!r}")


def _latency(name: str, result: LoadResult) -> dict[str, Any]:
    if result.num_errors:
        raise RuntimeError(f"{name}: {result.num_errors} errors: {result.sample_body[:200]!r}")
    ms = sorted(ns / 1e6 for ns in result.latencies_ns)
    return {
        f"{name}_p50_ms": round(statistics.median(ms), 4),
        f"{name}_p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 4),
    }


def _qps(result: LoadResult) -> float:
    return len(result.latencies_ns) / result.seconds


def _summary(server: str, stack: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    numeric = [k for k, v in runs[0].items() if isinstance(v, float | int) and k != "round"]
    medians = {k: statistics.median(r[k] for r in runs) for k in numeric}
    return {"summary": True, "server": server, "stack": stack, "rounds": len(runs)} | medians


def _request(api: Api, method: str, path: str, body: bytes, *, forwarded: bool = False) -> bytes:
    """A raw request; ``forwarded``: with the ``x-forwarded-for`` a load balancer adds (the
    server's protocol leaves such a request to the app)."""
    host, port = api.host_port
    head = f"{method} {path} HTTP/1.1\r\nhost: {host}:{port}\r\n"
    if forwarded:
        head += "x-forwarded-for: 10.0.0.1\r\n"
    if body:
        head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return (head + "\r\n").encode() + body


@contextmanager
def _api(server: str, stack: str, args: argparse.Namespace) -> Iterator[Api]:
    port = _free_port()
    command = [sys.executable, __file__, "--serve", server, stack, str(port)]
    command += ["--tokens", str(args.tokens), "--replicas", str(args.replicas)]
    api = Api(f"http://127.0.0.1:{port}", None, None)
    with running_api(command, api, ready_path="/healthz", timeout_s=_READY_S) as started:
        yield started


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# --- the serving side (the child process) ---------------------------------------------------


def _prompt(num_tokens: int) -> list[int]:
    return list(range(1000, 1000 + num_tokens))


def _replica(i: int) -> str:
    return f"replica-{i:02d}"


def _deps(args: argparse.Namespace, settings: ApiSettings) -> ApiDeps:
    """A memory-store fleet: replica i caches the first (i + 1)/replicas of the prompt."""
    index, registry = MemoryIndex(), Registry()
    ingestor = Ingestor(index)
    prompt, num_blocks = _prompt(args.tokens), args.tokens // BLOCK
    hashes = iter(range(1, 1 + args.replicas * num_blocks))
    for i in range(args.replicas):
        stream, cached = StreamId(_replica(i)), num_blocks * (i + 1) // args.replicas
        registry.add(ReplicaSpec(id=stream.replica, model=MODEL))
        event = BlockStored(
            block_hashes=tuple(next(hashes) for _ in range(cached)),
            parent_hash=None,
            token_ids=prompt[: cached * BLOCK],
            block_size=BLOCK,
            tier=Tier.GPU,
            lora_name=None,
        )
        ingestor.apply(stream, MODEL, EventBatch(0, time.time(), 0, [event]))
        report = StreamReport(
            block_size=BLOCK, last_seq=0, last_event_ts=time.time(), connected=True
        )
        registry.record(stream, report)
    return ApiDeps(settings, index, registry, MemoryLoadStore(), blocking_store=False)


def _serve(server: str, stack: str, port: int, args: argparse.Namespace) -> None:
    settings = ApiSettings(host="127.0.0.1", port=port)
    deps = _deps(args, settings)
    app: Any = _bare_app(deps) if stack == "bare" else create_app(deps, lean_routes=stack == "lean")
    if server == "uvicorn":
        from kvindex.api.http.app import hot_serving  # noqa: PLC0415 (the child's own import)
        from kvindex.api.http.server import run_app  # noqa: PLC0415

        run_app(app, settings, hot=hot_serving(app) if stack != "bare" else None)
    else:
        asyncio.run(_granian(app, settings))


async def _granian(app: Any, settings: ApiSettings) -> None:
    # Imported by name: granian is optional, and no type stubs are needed without it.
    interfaces = importlib.import_module("granian.constants").Interfaces
    embed = importlib.import_module("granian.server.embed")
    server = embed.Server(
        app,
        address=settings.host,
        port=settings.port,
        interface=interfaces.ASGI,
        log_enabled=False,
    )
    await server.serve()


def _bare_app(deps: ApiDeps) -> Any:
    """The floor: an ASGI callable answering ``GET /healthz`` and ``POST /score`` only."""
    scorer = Scorer(
        deps.settings,
        deps.index,
        deps.registry,
        deps.loads,
        tokenizers=lambda _model: None,
        blocking_store=deps.blocking_store,
    )
    head = [(b"content-type", b"application/json")]

    async def reply(send: Any, status: int, body: bytes) -> None:
        headers = [(b"content-length", str(len(body)).encode()), *head]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/healthz":
            await reply(send, 200, b'{"status":"ok"}')
            return
        if scope["path"] != "/score":
            await reply(send, 404, b'{"error":"not_found"}')
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        request, packed = decode_score_request(b"".join(chunks))  # as the app decodes it
        answer = await scorer.score(request, packed_tokens=packed)
        await reply(send, 200, msgspec.json.encode(answer))

    return app


if __name__ == "__main__":
    main()
