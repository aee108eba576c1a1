"""schemathesis over the served OpenAPI document: every operation, in-process (ASGI), over
the memory stores, with a bounded number of examples each.

Checks: no 5xx, and every answer is documented (status code, content type, body schema,
headers). Bodies are generated both valid and invalid (``positive`` and ``negative`` modes),
so the 4xx answers to bad input are checked against the schema too.
"""

from __future__ import annotations

import time
from typing import Any

import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from kvindex.api.config.settings import ApiSettings
from kvindex.api.http.app import create_app
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.runtime import ApiDeps
from kvindex.indexer.domain.events import BlockStored, EventBatch, StreamId, Tier
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.ingest.ingestor import Ingestor

MODEL = "demo-model"
BLOCK = 16
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


def _app_with_one_replica() -> FastAPI:
    """An app over the memory stores, with one live replica holding two blocks (so /score
    and /replicas answer with content, not only errors). Nothing is scraped."""
    index, registry = MemoryIndex(), Registry()
    registry.add(ReplicaSpec(id="r1", model=MODEL))
    stream = StreamId("r1")
    stored = BlockStored((1, 2), None, list(range(2 * BLOCK)), BLOCK, Tier.GPU)
    Ingestor(index).apply(stream, MODEL, EventBatch(0, time.time(), 0, [stored]))
    registry.record(
        stream,
        StreamReport(block_size=BLOCK, last_seq=0, last_event_ts=time.time(), connected=True),
    )
    settings_ = ApiSettings(scrape_interval_s=0)
    return create_app(ApiDeps(settings_, index, registry, MemoryLoadStore(), False))


schema = schemathesis.openapi.from_asgi("/openapi.json", _app_with_one_replica())
KNOWN = {"model": MODEL, "replica": "r1"}
"""Body fields that, set to a known name, get past the 404 / 422 of an unknown one."""


@schema.hook
def flatmap_body(context: schemathesis.HookContext, body: Any) -> st.SearchStrategy[Any]:
    """Half the object bodies name the known model and replica, so the answers past the
    name checks are fuzzed too."""
    if not isinstance(body, dict):
        return st.just(body)
    known = {name: value for name, value in KNOWN.items() if name in body}
    return st.sampled_from([body, body | known])


@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_every_operation_answers_as_documented(case: schemathesis.Case[Any]) -> None:
    case.call_and_validate(checks=CHECKS)
