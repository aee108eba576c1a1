"""kvindex.clients.picker.service: the picker's assembly on memory stores, fed in process."""

from __future__ import annotations

import asyncio

from kvindex.api.config.settings import load_api_settings
from kvindex.api.http.server import Service
from kvindex.clients.picker.service import build_picker
from kvindex.clients.picker.settings import PickerSettings
from kvindex.indexer.config.settings import load_settings
from kvindex.indexer.fleet.replica import ReplicaSpec
from tests.support.gateway import (
    FULL_DUPLEX,
    body_messages,
    headers_message,
    response_body_message,
    response_headers_message,
)
from tests.support.redis_server import free_ports

MODEL = "m"


def test_a_replica_that_answered_through_the_gateway_is_not_probed() -> None:
    """The answering replica's health check passes on its answer; the others are probed
    (nothing listens on their ports: their checks fail)."""
    ports = free_ports(3)
    specs = tuple(
        ReplicaSpec.parse(f"id=r{n},model={MODEL},url=http://127.0.0.1:{port}")
        for n, port in enumerate(ports)
    )
    api = load_api_settings({"health_check_timeout_s": 0.5}, [{"name": MODEL}], env={})
    service = Service.build(load_settings(extra_replicas=specs, env={}), api)
    picker = build_picker(service.deps, PickerSettings())

    async def run() -> str:
        exchange = picker.exchange()
        body = b'{"model": "m", "prompt": [1, 2, 3]}'
        for message in (
            headers_message({":method": "POST"}, mode=FULL_DUPLEX),
            *body_messages(body, 1),
        ):
            await exchange.handle(message)
        assert exchange.ticket is not None
        answered = exchange.ticket.replica
        await exchange.handle(response_headers_message(200))
        await exchange.handle(response_body_message(b"{}", True))
        await picker.read_path.health_checker.check_once()
        await picker.breakers.close()
        return answered

    try:
        answered = asyncio.run(run())
        health = service.deps.registry.replica_health()
    finally:
        service.stop()
    assert health[answered].check_failures == 0
    assert health[answered].check_successes == 1
    others = [r.id for r in specs if r.id != answered]
    assert all(health[r].check_failures == 1 for r in others), health
