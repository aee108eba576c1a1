"""Envoy's ``ExternalProcessor``: each ``Process`` stream is one :class:`Exchange`; whatever
ends it first (the response's end, a close, reset or cancel) releases its reservation once."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

from kvindex.clients.picker.admission import Admission
from kvindex.clients.picker.exchange import Exchange
from kvindex.clients.picker.messages import Response


class ExtProcServicer(external_processor_pb2_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, new_exchange: Callable[[], Exchange], admission: Admission) -> None:
        self._new_exchange = new_exchange
        self._admission = admission

    async def Process(  # noqa: N802 (the RPC's name in Envoy's proto)
        self, requests: AsyncIterator[Any], _context: Any
    ) -> AsyncIterator[Response]:
        exchange = self._new_exchange()
        try:
            async for request in requests:
                for answer in await exchange.handle(request):
                    yield answer
                await exchange.settle()  # the answers are written: owed work waits no one
                if exchange.finished:
                    return
        finally:  # closed, reset or cancelled before the response's end (a cancel can look
            # like a close: the messages end before the cancel reaches the handler)
            ticket = exchange.ticket
            if ticket is not None and not ticket.released:
                await self._admission.release(ticket, "abandoned")
