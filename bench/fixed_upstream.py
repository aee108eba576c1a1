"""Replicas that cost next to nothing: one process, one event loop, a fixed OpenAI answer on
each of the given ports, so a proxy in front of them is the bottleneck (``bench/proxy.py
--upstream fixed``). ``POST`` of any path: the chat completion below (a body with
``"stream": true``: the same as six server-sent events and ``[DONE]``, chunked); ``GET
/metrics``: vLLM's load gauges at zero; any other ``GET``: 200 and an empty JSON object.
Requests are read by httptools, kept alive. ``PORT,EVENTS``: a ZeroMQ PUB socket bound on
``EVENTS`` as well, which publishes nothing: the proxy's events stream is connected and its
replica routed as a healthy one, on load alone (no block is ever cached).

    python bench/fixed_upstream.py MODEL PORT[,EVENTS] [PORT[,EVENTS] ...]
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import cast

import httptools
import uvloop
import zmq

ANSWER = json.dumps(
    {
        "id": "chatcmpl-fixed",
        "object": "chat.completion",
        "created": 0,
        "model": "fixed",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "four words of answer"},
                "finish_reason": "length",
            }
        ],
    }
).encode()
_WHOLE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (
    len(ANSWER),
    ANSWER,
)
_EVENTS = (
    b"".join(
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":'
        b'{"content":"w%d "}}]}\n\n' % i
        for i in range(6)
    )
    + b"data: [DONE]\n\n"
)
_STREAMED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"%x\r\n%b\r\n0\r\n\r\n" % (len(_EVENTS), _EVENTS)
)
_EMPTY = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


def _metrics_answer(model: str) -> bytes:
    label = f'{{model_name="{model}"}}'
    text = "".join(
        f"# TYPE vllm:{name} gauge\nvllm:{name}{label} 0.0\n"
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    ).encode()
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n"
    return head % len(text) + text


class Fixed(asyncio.Protocol):
    """One connection: each whole request answered at once, in order."""

    def __init__(self, metrics: bytes) -> None:
        self.metrics = metrics
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        method, body = self.parser.get_method(), b"".join(self.body)
        self.body = []
        if method == b"POST":
            streamed = b'"stream": true' in body or b'"stream":true' in body
            self.transport.write(_STREAMED if streamed else _WHOLE)
        elif self.url.startswith(b"/metrics"):
            self.transport.write(self.metrics)
        else:
            self.transport.write(_EMPTY)


async def serve(model: str, ports: list[str]) -> None:
    loop = asyncio.get_running_loop()
    metrics = _metrics_answer(model)
    context = zmq.Context()
    publishers = []  # kept open while serving: a subscriber stays connected
    for spec in ports:
        port, _, events = spec.partition(",")
        await loop.create_server(lambda: Fixed(metrics), "127.0.0.1", int(port), backlog=1024)
        if events:
            publisher = context.socket(zmq.PUB)
            publisher.bind(f"tcp://127.0.0.1:{int(events)}")
            publishers.append(publisher)
    try:
        await asyncio.Event().wait()
    finally:
        for publisher in publishers:
            publisher.close(linger=0)
        context.term()


if __name__ == "__main__":
    uvloop.run(serve(sys.argv[1], sys.argv[2:]))
