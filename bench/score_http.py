"""The HTTP half of the read-path benchmark (``score.py``): the API process, its fill, the load.

* :func:`api_process` starts ``kvindex serve`` on a free loopback port (its stdout, where it
  prints a banner, goes to our stderr) and stops it.
* :func:`publish_fill` fills a memory-store server the way a fleet does: one vLLM-format
  publisher per replica (topic ``kv@<replica>@<model>``) connected to the server's bound SUB,
  then waits until ``GET /stats`` counts every batch and block.
* :func:`announce` makes the streams of a Redis-store server live when Redis was filled
  directly: each publisher skips (``drop=True``) the seqs the fill used, then sends one empty
  batch, so the server's registry holds a live status per stream as in production.
* :func:`run_load` is the load generator: pre-encoded request bytes sent on raw keep-alive
  sockets, one per worker thread (a blocking socket call releases the GIL, and the reply is
  parsed only as far as the status line and Content-Length). Each request's latency is
  measured from the first byte sent to the last byte received.
* :func:`py_spy` samples the API process while a run lasts; :func:`stack_summary` says
  where the samples went.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq
from score_fill import MODEL, Chunk, Fleet

from kvindex.api.schemas import LoadReport
from kvindex.clients.fake_vllm.publisher import EventPublisher

log = logging.getLogger("kvindex.bench")

_READY_TIMEOUT_S = 60.0
_SUBSCRIBE_S = 1.0
"""Pause between connecting the publishers and publishing (ZeroMQ's slow joiner: a PUB
drops what it sends before the SUB's subscription reached it)."""
_MAX_LAG_REPLICAS = 2
"""Publish at most this many replicas' batches ahead of what the server has applied."""
_RECV_BYTES = 1 << 16
_BARRIER_TIMEOUT_S = 300.0
_PUBLISHER_GROUP = 128
"""Publishers alive at once while filling (each is a ZeroMQ socket and a thread)."""


@dataclass(frozen=True, slots=True)
class Api:
    """A running API: where it answers, where it listens for events, its process id."""

    url: str
    events: str | None
    pid: int | None

    @property
    def host_port(self) -> tuple[str, int]:
        rest = self.url.split("://", 1)[1].rstrip("/")
        host, _, port = rest.rpartition(":")
        return host, int(port)


# --- small HTTP helpers (setup only; the load itself uses raw sockets) -----------------


def http_call(api: Api, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    host, port = api.host_port
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        headers = {"content-type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def get_json(api: Api, path: str) -> dict[str, Any]:
    status, body = http_call(api, "GET", path)
    if status != 200:
        raise RuntimeError(f"GET {path}: HTTP {status}: {body[:200]!r}")
    answer: dict[str, Any] = json.loads(body)
    return answer


def wait_until(what: str, check: Callable[[], bool], timeout_s: float, every_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


# --- the API process --------------------------------------------------------------------


def _serve_command(
    backend: str, port: int, events_port: int, config: Path, replicas: Sequence[str]
) -> list[str]:
    kvindex = str(Path(sys.executable).with_name("kvindex"))
    command = [kvindex, "serve", "--store", backend, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--bind", f"tcp://127.0.0.1:{events_port}"]
    command += ["--config", str(config)]
    for replica in replicas:
        command += ["--replica", f"id={replica},model={MODEL}"]
    return command


def _ready(api: Api, process: subprocess.Popen[bytes], path: str) -> bool:
    if process.poll() is not None:
        raise RuntimeError(f"the API process exited with {process.returncode}")
    try:
        return http_call(api, "GET", path)[0] == 200
    except OSError:
        return False


@contextmanager
def running_api(
    command: list[str], api: Api, *, ready_path: str = "/readyz", timeout_s: float
) -> Iterator[Api]:
    """``command`` started as the API answering at ``api``, once ``ready_path`` answers 200;
    terminated (killed after 15 s) on exit."""
    process = subprocess.Popen(command, stdout=sys.stderr.fileno(), stdin=subprocess.DEVNULL)
    api = Api(api.url, api.events, process.pid)
    try:
        wait_until("the API to be ready", lambda: _ready(api, process, ready_path), timeout_s, 0.1)
        yield api
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def api_process(
    backend: str,
    replicas: Sequence[str],
    *,
    config: Path,
    redis_url: str | None,
    ports: tuple[int, int],
) -> Iterator[Api]:
    """``kvindex serve`` on the given (API, events) loopback ports; stopped on exit."""
    command = _serve_command(backend, ports[0], ports[1], config, replicas)
    if redis_url is not None:
        command += ["--redis-url", redis_url]
    log.info("starting: %s ... (%d --replica flags)", " ".join(command[:12]), len(replicas))
    api = Api(f"http://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", None)
    with running_api(command, api, timeout_s=_READY_TIMEOUT_S) as started:
        yield started


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


# --- filling over ZeroMQ ------------------------------------------------------------------


def event_batches(chunks: list[Chunk], per_batch: int) -> list[list[Chunk]]:
    """Chunks grouped as a scheduler step publishes them (up to ``per_batch`` events)."""
    return [chunks[i : i + per_batch] for i in range(0, len(chunks), per_batch)]


def _groups(fleet: Fleet) -> list[range]:
    """The replicas' indices, :data:`_PUBLISHER_GROUP` at a time."""
    num = len(fleet.replica_ids)
    return [range(i, min(num, i + _PUBLISHER_GROUP)) for i in range(0, num, _PUBLISHER_GROUP)]


@contextmanager
def _publishing(fleet: Fleet, endpoint: str, group: range) -> Iterator[list[EventPublisher]]:
    """A publisher for each replica of ``group`` connected to ``endpoint``, on a context of
    their own; all closed on exit (what they sent and the server did not read is lost: wait
    for it first). A group at a time, because a publisher is a socket and a thread: a
    thousand at once pass libzmq's 1,023 sockets per context and slow every one down."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    publishers: list[EventPublisher] = []
    try:
        for i in group:
            topic = f"kv@{fleet.replica_ids[i]}@{MODEL}"
            publishers.append(EventPublisher(endpoint, topic=topic, bind=False, context=context))
        time.sleep(_SUBSCRIBE_S)
        yield publishers
    finally:
        for publisher in publishers:
            publisher.close()
        context.term()


def _applied(api: Api) -> tuple[int, int]:
    """(batches, GPU blocks) the server reports; raises as soon as it saw a gap (a batch
    lost, say to ZeroMQ's slow joiner) or an unreadable frame."""
    stats = get_json(api, "/stats")
    if stats["gaps"] or stats["decode_errors"]:
        raise RuntimeError(f"the API lost or could not read published batches: {stats}")
    return int(stats["batches"]), int(stats["blocks"]["gpu"])


def _wait_batches(api: Api, num_batches: int) -> None:
    wait_until("the server to catch up", lambda: _applied(api)[0] >= num_batches, 600, 0.05)


def _wait_streams(api: Api, num_streams: int) -> None:
    wait_until("the streams", lambda: get_json(api, "/stats")["streams"] >= num_streams, 60, 0.05)


def publish_fill(api: Api, fleet: Fleet, per_batch: int) -> dict[str, Any]:
    """Publish every replica's cache to the server; returns what ``/stats`` then says."""
    assert api.events is not None
    started = time.perf_counter()
    published: list[int] = []
    for group in _groups(fleet):
        with _publishing(fleet, api.events, group) as publishers:
            for i, publisher in zip(group, publishers, strict=True):
                if len(published) >= _MAX_LAG_REPLICAS:
                    _wait_batches(api, published[-_MAX_LAG_REPLICAS])
                batches = event_batches(fleet.chunks(i), per_batch)
                for batch in batches:
                    publisher.publish([chunk.event() for chunk in batch])
                published.append((published[-1] if published else 0) + len(batches))
            _wait_batches(api, published[-1])
    total = published[-1]
    wait_until("every batch", lambda: _applied(api) == (total, fleet.num_blocks), 600, 0.1)
    seconds = time.perf_counter() - started
    log.info("filled over ZeroMQ: %d batches, %d blocks in %.1fs (%.0f blocks/s)",
             total, fleet.num_blocks, seconds, fleet.num_blocks / seconds)  # fmt: skip
    return get_json(api, "/stats")


def announce(api: Api, fleet: Fleet, num_batches: dict[str, int]) -> dict[str, Any]:
    """Make every stream live after a direct fill that used seqs ``0 .. n - 1``."""
    assert api.events is not None
    for group in _groups(fleet):
        with _publishing(fleet, api.events, group) as publishers:
            for i, publisher in zip(group, publishers, strict=True):
                for _ in range(num_batches[fleet.replica_ids[i]]):
                    publisher.publish_payload(b"", drop=True)
                publisher.publish([])
            _wait_streams(api, group.stop)
    return get_json(api, "/stats")


def report_loads(api: Api, loads: dict[str, LoadReport]) -> None:
    """``POST /load`` for every replica (the scorer then weighs load as in production)."""
    for report in loads.values():
        status, body = http_call(api, "POST", "/load", msgspec.json.encode(report))
        if status != 200:
            raise RuntimeError(f"POST /load: HTTP {status}: {body[:200]!r}")


# --- the load generator -------------------------------------------------------------------


def score_request_bytes(api: Api, body: bytes) -> bytes:
    """A whole ``POST /score`` request, encoded once."""
    host, port = api.host_port
    head = (
        f"POST /score HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class RawConnection:
    """One keep-alive HTTP/1.1 connection; understands Content-Length replies only."""

    def __init__(self, host: str, port: int) -> None:
        self._sock = socket.create_connection((host, port), timeout=30)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = b""

    def close(self) -> None:
        self._sock.close()

    def _fill(self) -> None:
        data = self._sock.recv(_RECV_BYTES)
        if not data:
            raise ConnectionError("the server closed the connection")
        self._buf += data

    def exchange(self, request: bytes) -> tuple[int, bytes]:
        """Send one request; returns (status, body)."""
        self._sock.sendall(request)
        while (end := self._buf.find(b"\r\n\r\n")) < 0:
            self._fill()
        head, self._buf = self._buf[:end], self._buf[end + 4 :]
        length = _content_length(head)
        while len(self._buf) < length:
            self._fill()
        body, self._buf = self._buf[:length], self._buf[length:]
        return int(head[9:12]), body


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    raise ValueError(f"a reply without Content-Length: {head[:200]!r}")


@dataclass(slots=True)
class _Worker:
    """One connection's share of a run: its latencies (ns), failures and a reply."""

    latencies_ns: list[int] = field(default_factory=list)
    num_errors: int = 0
    body: bytes = b""
    """The first failed reply's body, else the last reply's."""
    error: BaseException | None = None


def _drive(conn: RawConnection, request: bytes, stop_at: float, limit: int, out: _Worker) -> None:
    """Up to ``limit`` requests back to back, stopping once ``stop_at`` (perf_counter) passed."""
    clock = time.perf_counter_ns
    stop_ns = stop_at * 1e9
    record = out.latencies_ns.append
    for _ in range(limit):
        started = clock()
        status, body = conn.exchange(request)
        ended = clock()
        record(ended - started)
        if status != 200 and not out.num_errors:
            out.body = body
        if status != 200:
            out.num_errors += 1
        elif not out.num_errors:
            out.body = body
        if ended >= stop_ns:
            break


@dataclass(frozen=True, slots=True)
class LoadPlan:
    concurrency: int
    warmup: int
    """Requests per connection before the timed part."""
    requests: int
    """Most requests per connection in the timed part."""
    duration_s: float
    """Longest timed part."""


@dataclass(frozen=True, slots=True)
class LoadResult:
    latencies_ns: list[int]
    """Of the timed requests; ``num_requests`` counts the warm-up too."""
    num_requests: int
    seconds: float
    client_cpu_s: float
    server_cpu_s: float | None
    num_errors: int
    sample_body: bytes


def _run_connection(
    api: Api, request: bytes, plan: LoadPlan, barrier: threading.Barrier, out: _Worker
) -> None:
    try:
        conn = RawConnection(*api.host_port)
        try:
            _drive(conn, request, math.inf, plan.warmup, _Worker())
            barrier.wait()
            _drive(conn, request, time.perf_counter() + plan.duration_s, plan.requests, out)
        finally:
            conn.close()
    except Exception as exc:  # reported by run_load, which must not wait forever
        out.error = exc
        barrier.abort()


def run_load(api: Api, request: bytes, plan: LoadPlan) -> LoadResult:
    """``plan.concurrency`` connections send ``request`` back to back (after a warm-up)."""
    barrier = threading.Barrier(plan.concurrency + 1, timeout=_BARRIER_TIMEOUT_S)
    workers = [_Worker() for _ in range(plan.concurrency)]
    threads = [
        threading.Thread(target=_run_connection, args=(api, request, plan, barrier, w))
        for w in workers
    ]
    for thread in threads:
        thread.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait()  # broken when a worker failed: its error is raised below
    started, cpu, server = time.perf_counter(), time.process_time(), process_cpu_s(api.pid)
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    failed = [w.error for w in workers if w.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(workers)} connections failed") from failed[0]
    client_cpu = time.process_time() - cpu
    server_after = process_cpu_s(api.pid)
    server_cpu = None if server is None or server_after is None else server_after - server
    latencies = [ns for w in workers for ns in w.latencies_ns]
    return LoadResult(
        latencies,
        len(latencies) + plan.concurrency * plan.warmup,
        seconds,
        client_cpu,
        server_cpu,
        sum(w.num_errors for w in workers),
        workers[0].body,
    )


# --- sampling the API process ----------------------------------------------------------------


@contextmanager
def py_spy(pid: int | None, output: Path | None) -> Iterator[None]:
    """Sample the API process with py-spy (raw collapsed stacks) while the block runs."""
    binary = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if output is None or pid is None:
        yield
        return
    if not Path(binary).exists():
        raise SystemExit("--server-profile needs py-spy on PATH or beside this python")
    # Sampling pauses the API (py-spy's default): exact stacks, slower answers meanwhile.
    command = [binary, "record", "--pid", str(pid), "--format", "raw", "--rate", "100"]
    command += ["--output", str(output)]
    sampler = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        sampler.send_signal(signal.SIGINT)  # py-spy writes its output, then exits
        try:
            sampler.wait(timeout=30)
        except subprocess.TimeoutExpired:
            sampler.kill()
            sampler.wait()


def stack_summary(path: Path, top: int = 25, skip: str = "Subscriber._run") -> str:
    """Where the sampled time went (stacks through ``skip``, the idle subscriber thread, left
    out): functions by own time, then by time spent in or below them (the frames common to
    nearly every stack, the server's trunk, left out)."""
    own: Counter[str] = Counter()
    below: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [_function(frame) for frame in stack.split(";") if frame]
        if not frames or not count.isdigit() or any(skip in f for f in frames):
            continue
        own[frames[-1]] += int(count)
        for frame in set(frames):
            below[frame] += int(count)
    total = sum(own.values()) or 1
    lines = [f"{total} samples; own time:"]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in own.most_common(top)]
    lines.append("in or below (frames in < 90% of the samples):")
    inner = [(name, n) for name, n in below.most_common() if n < 0.9 * total][:top]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in inner]
    return "\n".join(lines)


def _function(frame: str) -> str:
    """``name (path/to/file.py:123)`` → ``name (path/to/file.py)``."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})"
