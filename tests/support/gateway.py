"""A gateway stand-in: the ext_proc message sequences an Envoy-based gateway sends an endpoint
picker, built from Envoy's own protos, over a real gRPC channel. One :meth:`Gateway.request` is
one ``Process`` stream: request headers (with the subset hint), the body in chunks, then what
the test asks (response headers and body to its end, a half-close, or a cancel)."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
STREAMED = processing_mode_pb2.ProcessingMode.STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
_END = object()


def headers_message(
    headers: dict[str, str],
    *,
    end_of_stream: bool = False,
    subset: Sequence[str] | None = None,
    mode: int = FULL_DUPLEX,
    no_wait: bool = False,
) -> Any:
    """The first message: request headers, the protocol config, the subset hint if any."""
    header_map = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    )
    metadata = base_pb2.Metadata()
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.fields["x-gateway-destination-endpoint-subset"].list_value.extend(list(subset))
        metadata.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    config = pb.ProtocolConfiguration(
        request_body_mode=mode,
        response_body_mode=mode,
        send_body_without_waiting_for_header_response=no_wait,
    )
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map, end_of_stream=end_of_stream),
        metadata_context=metadata,
        protocol_config=config,
    )


def body_messages(body: bytes, num_chunks: int) -> list[Any]:
    """``body`` in ``num_chunks`` request-body messages, the last with end of stream."""
    size = max(1, -(-len(body) // num_chunks))
    pieces = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    last = len(pieces) - 1
    return [
        pb.ProcessingRequest(request_body=pb.HttpBody(body=p, end_of_stream=n == last))
        for n, p in enumerate(pieces)
    ]


def response_headers_message(status: int | str = 200, served: str | None = None) -> Any:
    metadata = base_pb2.Metadata()
    if served is not None:
        metadata.filter_metadata["envoy.lb"].fields[
            "x-gateway-destination-endpoint-served"
        ].string_value = served
    header_map = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=":status", raw_value=str(status).encode())]
    )
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=header_map), metadata_context=metadata
    )


def response_body_message(body: bytes, end_of_stream: bool) -> Any:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=end_of_stream))


@dataclass
class Picked:
    """What the picker answered a request's request phase."""

    answers: list[Any] = field(default_factory=list)

    @property
    def immediate_status(self) -> int | None:
        for answer in self.answers:
            if answer.HasField("immediate_response"):
                return int(answer.immediate_response.status.code)
        return None

    @property
    def header(self) -> str | None:
        """``x-gateway-destination-endpoint`` as the header mutation sets it."""
        for answer in self.answers:
            kind = answer.WhichOneof("response")
            if kind in ("request_headers", "request_body"):
                common = getattr(answer, kind).response
                for option in common.header_mutation.set_headers:
                    if option.header.key == "x-gateway-destination-endpoint":
                        return bytes(option.header.raw_value).decode()
        return None

    @property
    def metadata(self) -> str | None:
        """``envoy.lb`` → ``x-gateway-destination-endpoint`` in the dynamic metadata."""
        for answer in self.answers:
            fields = answer.dynamic_metadata.fields
            if "envoy.lb" in fields:
                inner = fields["envoy.lb"].struct_value.fields
                return str(inner["x-gateway-destination-endpoint"].string_value)
        return None

    @property
    def endpoints(self) -> list[str]:
        return (self.header or "").split(",") if self.header else []

    def body_sent_back(self) -> bytes:
        """The request body the picker streamed back (full-duplex mode)."""
        return b"".join(
            a.request_body.response.body_mutation.streamed_response.body
            for a in self.answers
            if a.WhichOneof("response") == "request_body"
        )


class Stream:
    """One open ``Process`` stream: messages are sent in order, answers read as they come."""

    def __init__(self, stub: Any, timeout_s: float) -> None:
        self._outbox: queue.Queue[Any] = queue.Queue()
        self._timeout_s = timeout_s
        self.call = stub.Process(self._messages(), timeout=timeout_s)
        self._answers: queue.Queue[Any] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _messages(self) -> Iterator[Any]:
        while (message := self._outbox.get()) is not _END:
            yield message

    def _read(self) -> None:
        try:
            for answer in self.call:
                self._answers.put(answer)
        except grpc.RpcError as exc:
            self._answers.put(exc)
        self._answers.put(_END)

    def send(self, *messages: Any) -> None:
        for message in messages:
            self._outbox.put(message)

    def answers(self, count: int) -> list[Any]:
        """The next ``count`` answers (fewer if the stream ends first)."""
        got: list[Any] = []
        deadline = time.monotonic() + self._timeout_s
        while len(got) < count:
            answer = self._answers.get(timeout=max(0.01, deadline - time.monotonic()))
            if answer is _END:
                self._answers.put(_END)
                break
            if isinstance(answer, grpc.RpcError):
                raise answer
            got.append(answer)
        return got

    def until_immediate_or(self, count: int) -> list[Any]:
        """Answers until ``count`` came, or an ImmediateResponse (which ends the stream)."""
        got: list[Any] = []
        while len(got) < count:
            batch = self.answers(1)
            if not batch:
                break
            got += batch
            if batch[0].HasField("immediate_response"):
                break
        return got

    def half_close(self) -> None:
        self._outbox.put(_END)

    def cancel(self) -> None:
        self.call.cancel()

    def ended(self) -> bool:
        self._reader.join(self._timeout_s)
        return not self._reader.is_alive()


class Gateway:
    """A gRPC channel to a picker and the requests a gateway sends over it."""

    def __init__(self, port: int, timeout_s: float = 20.0) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)
        self.timeout_s = timeout_s

    def close(self) -> None:
        self.channel.close()

    def open(self) -> Stream:
        return Stream(self.stub, self.timeout_s)

    def pick(
        self,
        body: dict[str, Any] | bytes,
        *,
        num_chunks: int = 3,
        subset: Sequence[str] | None = None,
        mode: int = FULL_DUPLEX,
        no_wait: bool = True,
    ) -> tuple[Stream, Picked]:
        """Request headers and the body in ``num_chunks``: the stream (open) and the answers
        owed to the request phase (2 in full duplex: headers, body; streamed: 1 + chunks)."""
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        stream = self.open()
        headers = {
            ":method": "POST",
            ":path": "/v1/chat/completions",
            "content-type": "application/json",
        }
        stream.send(headers_message(headers, subset=subset, mode=mode, no_wait=no_wait))
        chunks = body_messages(raw, num_chunks)
        stream.send(*chunks)
        owed = 2 if mode == FULL_DUPLEX else 1 + len(chunks)
        return stream, Picked(stream.until_immediate_or(owed))

    def finish(self, stream: Stream, served: str | None = None, num_chunks: int = 2) -> list[Any]:
        """The response: headers, a body in ``num_chunks`` to its end; the answers."""
        stream.send(response_headers_message(200, served))
        for n in range(num_chunks):
            stream.send(response_body_message(b"data: {}\n\n", n == num_chunks - 1))
        answers = stream.answers(1 + num_chunks)
        stream.half_close()
        return answers
