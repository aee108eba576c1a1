"""The ext_proc answers, from Envoy's generated protos: the endpoint as a header and as
``envoy.lb`` dynamic metadata (one value), bodies passed on, an ImmediateResponse otherwise."""

from __future__ import annotations

import json
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2

from kvindex.clients.picker.endpoints import DESTINATION_KEY, DESTINATION_NAMESPACE

Response = Any
"""An ``envoy.service.ext_proc.v3.ProcessingResponse`` (the protos carry no type hints)."""


def destination(endpoints: tuple[str, ...], num_body_bytes: int, *, in_body: bool) -> Response:
    """The answer naming ``endpoints`` (primary first): ``x-gateway-destination-endpoint`` set
    and ``envoy.lb`` metadata, on the request headers' answer (``in_body``: on the body's, for
    a gateway that waits for the headers' answer before sending the body)."""
    value = ",".join(endpoints)
    answer = pb.ProcessingResponse()
    # Set in place: nested keyword messages would each be built, then copied in.
    common = (answer.request_body if in_body else answer.request_headers).response
    common.clear_route_cache = True
    _set_header(common.header_mutation.set_headers.add(), DESTINATION_KEY, value)
    if num_body_bytes:
        _set_header(common.header_mutation.set_headers.add(), "content-length", str(num_body_bytes))
    lb = answer.dynamic_metadata.fields[DESTINATION_NAMESPACE].struct_value
    lb.fields[DESTINATION_KEY].string_value = value
    return answer


def _set_header(option: Any, key: str, value: str) -> None:
    option.header.key = key
    option.header.raw_value = value.encode()


def _header(key: str, value: str) -> Any:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode())
    )


def request_headers_continue() -> Response:
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse())


def response_headers_continue() -> Response:
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse())


def body_continue(*, response: bool) -> Response:
    """A body chunk passed on as it came (streamed and buffered modes)."""
    if response:
        return pb.ProcessingResponse(response_body=pb.BodyResponse())
    return pb.ProcessingResponse(request_body=pb.BodyResponse())


def body_streamed(body: bytes, end_of_stream: bool, *, response: bool) -> Response:
    """``body`` sent back to the gateway (full-duplex mode: what is not sent back is lost)."""
    answer = pb.ProcessingResponse()
    common = (answer.response_body if response else answer.request_body).response
    streamed = common.body_mutation.streamed_response
    streamed.body = body
    streamed.end_of_stream = end_of_stream
    return answer


def trailers_continue(*, response: bool, like: Response | None = None) -> Response:
    """Trailers passed on; with the dynamic metadata of ``like`` when given."""
    if response:
        return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
    answer = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
    if like is not None:
        answer.dynamic_metadata.CopyFrom(like.dynamic_metadata)
    return answer


def immediate(status: int, message: str) -> Response:
    """The gateway answers the client itself: ``status`` with an OpenAI-shaped JSON error."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=[_header("content-type", "application/json")]),
            body=body,
            details=f"kvindex_picker_{status}",
        )
    )
