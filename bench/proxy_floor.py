"""The server's own cost of a forwarded route's request: one ASGI endpoint answering a fixed
body (as the proxy passes an answer on: a start message, one body message; ``--stream``:
six parts, chunked), served by
uvicorn's request cycle (the API's protocol, no hot routes) or by the proxy's
:class:`~kvindex.clients.proxy.front_protocol.FrontProtocol`, alternated in rounds.

Each server is a subprocess on a free loopback port; one client thread sends ``--requests``
``POST /v1/chat/completions`` (a ``--body-bytes`` body) on a keep-alive connection, and the
server's CPU time per request is read from ``/proc``. One JSON line per (round, protocol),
then one with the machine's load.

    python bench/proxy_floor.py [--requests 4000] [--rounds 4] [--body-bytes 11000] [--stream]
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import calibration_ms, host_load
from score_http import process_cpu_s

from tests.support.redis_server import free_port

ROUTE = "/v1/chat/completions"
ANSWER = json.dumps({"id": "x", "choices": [{"text": "four words of answer"}]}).encode()

_SERVER = """
import sys
import uvicorn
from kvindex.api.http.server_protocol import hot_protocol
from kvindex.clients.proxy.front_protocol import front_protocol

ANSWER = %r
STREAM = sys.argv[3] == "stream"
HEADERS = [(b"content-type", b"application/json")]
if not STREAM:
    HEADERS.append((b"content-length", b"%%d" %% len(ANSWER)))


async def endpoint(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    if STREAM:  # six events, then the end
        part = len(ANSWER) // 6 + 1
        for at in range(0, len(ANSWER), part):
            more = {"type": "http.response.body", "body": ANSWER[at : at + part], "more_body": True}
            await send(more)
    await send({"type": "http.response.body", "body": b"" if STREAM else ANSWER})


protocol = hot_protocol(5.0, None)
if sys.argv[2] == "front":
    protocol = front_protocol(protocol, {%r: endpoint}, 1 << 20)
uvicorn.run(
    endpoint, port=int(sys.argv[1]), http=protocol, log_level="warning", access_log=False,
    lifespan="off", server_header=False, date_header=False,
)
"""


def _serve(kind: str, stream: bool) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    code = _SERVER % (ANSWER, ROUTE)
    shape = "stream" if stream else "whole"
    server = subprocess.Popen([sys.executable, "-c", code, str(port), kind, shape])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            http.client.HTTPConnection("127.0.0.1", port, timeout=1).connect()
            return server, port
        except OSError:
            time.sleep(0.05)
    server.kill()
    raise RuntimeError(f"the {kind} server did not start")


def _cpu_per_request_ms(port: int, pid: int, body: bytes, num_requests: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"content-type": "application/json"}
    for _ in range(200):  # warm
        conn.request("POST", ROUTE, body, headers)
        conn.getresponse().read()
    before = process_cpu_s(pid) or 0.0
    for _ in range(num_requests):
        conn.request("POST", ROUTE, body, headers)
        response = conn.getresponse()
        if response.read() != ANSWER:
            raise RuntimeError("wrong answer")
    after = process_cpu_s(pid) or 0.0
    conn.close()
    return 1000 * (after - before) / num_requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4000, help="Requests a measurement.")
    parser.add_argument("--rounds", type=int, default=4, help="Alternated rounds.")
    parser.add_argument("--body-bytes", type=int, default=11000, help="The request's body.")
    parser.add_argument("--stream", action="store_true", help="A chunked answer, six parts.")
    args = parser.parse_args()
    body = b'{"messages": "' + b"x" * max(0, args.body_bytes - 16) + b'"}'
    servers = {kind: _serve(kind, args.stream) for kind in ("uvicorn", "front")}
    try:
        for number in range(args.rounds):
            for kind, (server, port) in servers.items():
                ms = _cpu_per_request_ms(port, server.pid, body, args.requests)
                line = {
                    "bench": "proxy_floor",
                    "round": number,
                    "cycle": kind,
                    "stream": args.stream,
                }
                print(json.dumps(line | {"server_cpu_ms_per_request": round(ms, 4)}), flush=True)
    finally:
        for server, _ in servers.values():
            server.terminate()
            server.wait(10)
    machine = {"load_1m": round(host_load(), 2), "calibration_ms": round(calibration_ms(), 2)}
    print(json.dumps({"bench": "proxy_floor", "machine": machine}), flush=True)


if __name__ == "__main__":
    main()
