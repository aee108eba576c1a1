"""What hostile bodies cost ``kvindex proxy`` in memory: ``--bodies`` distinct chat bodies of
``--body-mb`` MB each sent through a proxy one after another, and the growth of the proxy's
resident set (``VmRSS`` of ``/proc/<pid>/status``) over its size after a warm-up of small
requests. Every body is a new prompt (a miss of the tokenizer cache), so whatever the proxy
keeps per request shows as growth.

One ``kvindex replica-sim`` (time compressed a millionfold; its toy tokenizer makes one token
per word, so ``--word-bytes`` sets the tokens per body) and the proxy (memory store, its own
subscriber) run as subprocesses on free loopback ports. A JSON line every ``--every``
bodies, then a summary line with the largest growth seen and the machine's load.

    python bench/proxy_memory.py [--bodies 1000] [--body-mb 7] [--word-bytes 32]
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import calibration_ms, host_load

from tests.support.processes import http_ok, kvindex_child
from tests.support.redis_server import free_port

MODEL = "demo-model"
_WARM_UP = 16


def vm_rss_kib(pid: int) -> int:
    """The resident set of process ``pid`` in KiB (``VmRSS`` of ``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


def chat_body(number: int, size: int, word_bytes: int) -> bytes:
    """A chat body of about ``size`` bytes whose one message starts with ``number`` (every
    body distinct), in words of ``word_bytes`` bytes."""
    word = "w" * (word_bytes - 1) + " "
    content = f"body {number} " + word * max(0, (size - 120) // len(word))
    message = {"role": "user", "content": content}
    return json.dumps({"model": MODEL, "messages": [message], "max_tokens": 1}).encode()


def post(port: int, body: bytes) -> int:
    """``POST /v1/chat/completions`` on a fresh connection; the answer's status."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request(
            "POST", "/v1/chat/completions", body, {"content-type": "application/json"}
        )
        answer = connection.getresponse()
        answer.read()
        return answer.status
    finally:
        connection.close()


def _start(stack: ExitStack, workdir: Path) -> tuple[int, int]:
    """A replica-sim and a proxy in front of it: (the proxy's port, its pid)."""
    sim_port, events = free_port(), f"tcp://127.0.0.1:{free_port()}"
    args = [
        "replica-sim", "--id", "r1", "--model", MODEL, "--port", str(sim_port),
        "--events", events, "--bind-events", "--replay", "", "--speed", "1000000",
        "--capacity-blocks", "16384",
    ]  # fmt: skip
    sim = kvindex_child(
        "sim",
        args,
        workdir / "sim.log",
        http_ok(sim_port, "/health"),
    )
    stack.callback(sim.stop)
    sim.start(60)
    port = free_port()
    spec = f"id=r1,model={MODEL},url=http://127.0.0.1:{sim_port},events={events}"
    proxy = kvindex_child(
        "proxy",
        ["proxy", "--port", str(port), "--replica", spec],
        workdir / "proxy.log",
        http_ok(port, "/readyz"),
    )
    stack.callback(proxy.stop)
    proxy.start(60)
    assert proxy.process is not None
    return port, proxy.process.pid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bodies", type=int, default=1000, help="Distinct large bodies sent.")
    parser.add_argument("--body-mb", type=float, default=7.0, help="Size of each body (MB).")
    parser.add_argument("--word-bytes", type=int, default=32, help="Bytes per prompt word.")
    parser.add_argument("--every", type=int, default=50, help="Bodies between two lines.")
    args = parser.parse_args()
    size = int(args.body_mb * 1_000_000)
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        port, pid = _start(stack, Path(tmp))
        for number in range(_WARM_UP):
            post(port, chat_body(-number, 2_000, args.word_bytes))
        base_kib = peak_kib = vm_rss_kib(pid)
        started = time.perf_counter()
        statuses: dict[int, int] = {}
        for number in range(1, args.bodies + 1):
            status = post(port, chat_body(number, size, args.word_bytes))
            statuses[status] = statuses.get(status, 0) + 1
            rss_kib = vm_rss_kib(pid)
            peak_kib = max(peak_kib, rss_kib)
            if number % args.every == 0 or number == args.bodies:
                line = {
                    "bench": "proxy_memory",
                    "bodies": number,
                    "rss_mb": round(rss_kib / 1024, 1),
                    "growth_mb": round((rss_kib - base_kib) / 1024, 1),
                    "elapsed_s": round(time.perf_counter() - started, 1),
                }
                print(json.dumps(line), flush=True)
        summary = {
            "bench": "proxy_memory",
            "bodies": args.bodies,
            "body_bytes": len(chat_body(args.bodies, size, args.word_bytes)),
            "statuses": {str(s): n for s, n in sorted(statuses.items())},
            "base_rss_mb": round(base_kib / 1024, 1),
            "peak_growth_mb": round((peak_kib - base_kib) / 1024, 1),
            "seconds_per_body": round((time.perf_counter() - started) / args.bodies, 3),
            "machine": {"load_1m": round(host_load(), 2), "calibration_ms": calibration_ms()},
        }
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
