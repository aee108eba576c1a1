"""vLLM's own captured payloads, published over real ZeroMQ into the indexer."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.domain.keys import block_keys
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.ingest.wire import ReplayLayout
from tests.integration.harness import (
    publisher_at,
    replica_of,
    running_indexer,
    settings_for,
    wait_until,
    warm_up,
)

FIXTURES = Path(__file__).parents[1] / "fixtures"
CAPTURES = {"0.33.0": "topic", "0.23.0": "legacy"}


def _load(version: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"vllm-{version}-kv-events.json").read_text())
    return data


@pytest.mark.parametrize("version", sorted(CAPTURES))
def test_captured_rank0_stream_builds_the_expected_index(version: str) -> None:
    capture = _load(version)
    layout: ReplayLayout = CAPTURES[version]  # type: ignore[assignment]
    vectors = [v for v in capture["vectors"] if v["channel"] == "pub" and "rank0" in v["id"]]
    pub = publisher_at(None, None, topic="kv@pod-a@demo-model", replay_layout=layout)
    index = MemoryIndex()
    stream = StreamId("pod-a", 0)
    try:
        with running_indexer(settings_for(replica_of(pub, "pod-a")), index) as ix:
            warm_up(ix, pub, stream)
            for vector in vectors:
                payload = base64.b64decode(vector["frames_b64"][2])
                seq = pub.publish_payload(payload, drop=vector["id"].endswith("seq2"))
            wait_until(ix.applied(stream, seq))
            tokens = [t for block in capture["meta"]["hashing"]["blocks_token_ids"] for t in block]
            keys = block_keys("demo-model", tokens, 16)
            # seq5 cleared everything; seq6 stored the first two blocks and removed one of them
            assert index.longest_prefix(keys, [stream])[stream].num_blocks == 1
            health = ix.status(stream).health
            assert health.num_gaps == 1  # seq2 dropped live, repaired by replay
            assert health.num_decode_errors == 0 and health.num_bad_events == 0
    finally:
        pub.close()
