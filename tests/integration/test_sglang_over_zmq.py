"""SGLang 0.5.23's own captured payloads, published over real ZeroMQ into the indexer: salted
and LoRA stores keyed as vLLM's would be, host-memory stores, removals, the clear, rank 1."""

from __future__ import annotations

import base64
import json
from typing import Any

from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.domain.keys import block_keys
from kvindex.indexer.fleet.registry import Freshness
from kvindex.indexer.index.memory import MemoryIndex
from tests.integration.harness import (
    MODEL,
    consecutive_free_ports,
    publisher_at,
    replica_of,
    running_indexer,
    settings_for,
    wait_until,
    warm_up,
)
from tests.support.paths import FIXTURES

CAPTURE: dict[str, Any] = json.loads((FIXTURES / "sglang-0.5.23-kv-events.json").read_text())
PAGE = CAPTURE["meta"]["page_size"]
TOPIC = f"kv@pod-s@{MODEL}"


def _payloads(prefix: str) -> list[bytes]:
    chosen = [v for v in CAPTURE["vectors"] if v["id"].startswith(prefix)]
    return [base64.b64decode(v["frames_b64"][2]) for v in chosen]


def _tokens(payload_index: int, event_index: int, prefix: str = "pub-rank0-seq") -> list[int]:
    vector = next(v for v in CAPTURE["vectors"] if v["id"] == f"{prefix}{payload_index}")
    tokens: list[int] = vector["payload_decoded"][1][event_index]["token_ids"]
    return tokens


def test_captured_rank0_stream_keys_salt_and_lora_as_vllms_would() -> None:
    payloads = _payloads("pub-rank0-seq")
    plain = _tokens(0, 0) + _tokens(1, 0)  # 2 pages, then a child page
    salted = _tokens(1, 1) + _tokens(3, 1)  # 2 salted pages, then a salted child page
    pub = publisher_at(None, None, topic=TOPIC)
    index = MemoryIndex()
    stream = StreamId("pod-s", 0)

    def held(tokens: list[int], **extras: str) -> tuple[Tier, ...]:
        keys = block_keys(MODEL, tokens, PAGE, **extras)
        return index.longest_prefix(keys, [stream])[stream].tiers

    try:
        with running_indexer(settings_for(replica_of(pub, "pod-s")), index) as ix:
            warm_up(ix, pub, stream)
            for payload in payloads[:4]:
                seq = pub.publish_payload(payload)
            wait_until(ix.applied(stream, seq))
            assert held(plain) == (Tier.GPU, Tier.GPU, Tier.GPU)
            assert held(plain[: 2 * PAGE]) == (Tier.GPU, Tier.GPU)  # best tier: GPU over CPU
            assert held(salted, cache_salt="tenant-a") == (Tier.GPU,) * 3
            assert held(salted, cache_salt="tenant-b") == ()
            assert held(salted) == (Tier.GPU, Tier.GPU)  # the plain pages: same tokens, no salt
            assert held(_tokens(2, 0), lora_name="sql-lora") == (Tier.GPU, Tier.GPU)
            assert held(_tokens(2, 0), lora_name="other-lora") == ()
            seq = pub.publish_payload(payloads[4])  # GPU child page and the CPU copies removed
            wait_until(ix.applied(stream, seq))
            assert held(plain) == (Tier.GPU, Tier.GPU)
            seq = pub.publish_payload(payloads[5])  # AllBlocksCleared
            wait_until(ix.applied(stream, seq))
            assert held(plain) == held(salted, cache_salt="tenant-a") == ()
            health = ix.status(stream).health
            assert health.num_decode_errors == 0 and health.num_bad_events == 0
    finally:
        pub.close()


def test_captured_rank1_stream_is_its_own_stream_on_base_port_plus_one() -> None:
    base, replay = consecutive_free_ports(2), consecutive_free_ports(2)
    pubs = [publisher_at(base + r, replay + r, topic=TOPIC, rank=r) for r in (0, 1)]
    index = MemoryIndex()
    streams = [StreamId("pod-s", r) for r in (0, 1)]
    chain = _tokens(0, 0, "pub-rank1-seq") + _tokens(1, 0, "pub-rank1-seq")
    keys = block_keys(MODEL, chain, PAGE)
    try:
        spec = replica_of(pubs[0], "pod-s", dp_size=2)
        with running_indexer(settings_for(spec), index) as ix:
            for pub, stream in zip(pubs, streams, strict=True):
                warm_up(ix, pub, stream)
            rank1 = _payloads("pub-rank1-seq")
            for payload in rank1[:2]:
                seq = pubs[1].publish_payload(payload)
            wait_until(ix.applied(streams[1], seq))
            found = index.longest_prefix(keys, streams)
            assert (found[streams[0]].num_blocks, found[streams[1]].num_blocks) == (0, 2)
            seq = pubs[1].publish_payload(rank1[2])  # the chain's first page removed
            wait_until(ix.applied(streams[1], seq))
            assert index.longest_prefix(keys, streams)[streams[1]].num_blocks == 0
            assert ix.status(streams[1]).freshness is Freshness.LIVE
    finally:
        for pub in pubs:
            pub.close()
