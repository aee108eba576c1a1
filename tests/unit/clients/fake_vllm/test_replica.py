"""The replica simulator without sockets: block pool, events, time model, handlers."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import pytest
from fastapi import Response

from kvindex.api.load.vllm_metrics import parse_vllm_metrics
from kvindex.clients.fake_vllm.replica import (
    BlockCache,
    Engine,
    ReplicaSimError,
    ReplicaSimSettings,
    SimRequest,
    SimResult,
    block_hash,
    handle_completion,
    handle_tokenize,
    metrics_text,
    none_hash,
    render_chat,
    service_times,
    tokenize_text,
)
from kvindex.indexer.events import BlockRemoved, BlockStored, Event, EventBatch, StreamId, Tier
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.keys import block_keys

ROOT = 7


def cache(capacity: int = 4, block_size: int = 2) -> BlockCache:
    return BlockCache(capacity, block_size, ROOT)


def h(*blocks: tuple[int, ...], extras: tuple[object, ...] | None = None) -> list[int]:
    """Hand-computed chain of hashes for blocks (no extra keys unless given for all)."""
    out: list[int] = []
    parent = ROOT
    for block in blocks:
        parent = block_hash(parent, block, extras)
        out.append(parent)
    return out


def test_first_request_stores_its_full_prompt_blocks_then_its_output_blocks() -> None:
    c = cache()
    h12, h34, h56 = h((1, 2), (3, 4), (5, 6))
    admission = c.admit(0, [1, 2, 3, 4, 5], 6)
    assert admission is not None
    assert admission.num_hit_blocks == 0
    assert admission.events == [BlockStored((h12, h34), None, (1, 2, 3, 4), 2, Tier.GPU)]
    assert c.num_empty == 1  # 3 blocks reserved for 6 tokens
    assert c.finish(0, [1, 2, 3, 4, 5, 6]) == [BlockStored((h56,), h34, (5, 6), 2, Tier.GPU)]
    c.release(0)
    assert c.evictable() == [h56, h34, h12]  # freed tail first: the tail is evicted first
    c.check()


def test_leading_cached_blocks_are_hits_but_one_prompt_token_is_always_computed() -> None:
    c = cache()
    assert c.admit(0, [1, 2, 3, 4, 5], 6) is not None
    c.release(0)
    second = c.admit(1, [1, 2, 3, 4, 9], 5)
    assert second is not None
    assert second.num_hit_blocks == 2
    assert second.events == []  # hits are not announced again
    c.release(1)
    exact = c.admit(2, [1, 2, 3, 4], 4)  # both blocks cached, but only 1 may hit
    assert exact is not None
    assert exact.num_hit_blocks == 1
    assert exact.events == []  # the recomputed last block is the cached one, shared
    c.release(2)
    c.check()


def test_lru_eviction_order_and_removed_events() -> None:
    c = cache()
    h12, h34, h56 = h((1, 2), (3, 4), (5, 6))
    assert c.admit(0, [1, 2, 3, 4, 5], 6) is not None
    c.finish(0, [1, 2, 3, 4, 5, 6])
    c.release(0)
    admission = c.admit(1, [7, 8, 9, 10, 11], 6)  # 3 blocks: 1 empty + 2 evicted
    assert admission is not None
    removed = [e for e in admission.events if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved((h56,), Tier.GPU), BlockRemoved((h34,), Tier.GPU)]
    assert isinstance(admission.events[-1], BlockStored)
    assert c.is_cached(h12) and not c.is_cached(h34)
    c.check()


def test_hit_refreshes_lru_position() -> None:
    c = cache(capacity=6)
    assert c.admit(0, [1, 2, 3], 4) is not None  # caches (1,2)
    c.release(0)
    assert c.admit(1, [5, 6, 7], 4) is not None  # caches (5,6)
    c.release(1)
    assert c.admit(2, [1, 2, 9], 3) is not None  # hit on (1,2): it becomes most recent
    c.release(2)
    h12, h56 = h((1, 2))[0], h((5, 6))[0]
    assert c.evictable() == [h56, h12]


def test_pinned_blocks_are_never_evicted_and_capacity_is_never_exceeded() -> None:
    c = cache()
    assert c.admit(0, [1, 2, 3], 4) is not None  # holds 2 blocks, (1,2) cached and pinned
    assert c.admit(1, [5, 6], 4) is not None  # the other 2
    assert c.admit(2, [9, 9, 9], 3) is None  # no room: nothing is evictable
    assert c.num_used_blocks == 4
    assert c.usage == 1.0
    c.check()
    c.release(1)
    assert c.admit(2, [9, 9, 9], 3) is not None  # (5,6) evicted, (1,2) still pinned
    assert c.is_cached(h((1, 2))[0])
    c.check()


def test_salt_on_first_block_only_and_lora_on_every_block() -> None:
    c = cache(capacity=9)
    salted = c.admit(0, [1, 2, 3, 4, 5], 5, cache_salt="s")
    assert salted is not None
    [event] = salted.events
    assert isinstance(event, BlockStored)
    assert event.lora_name is None
    assert event.extra_keys == (("s",), None)
    assert event.block_hashes[0] == block_hash(ROOT, (1, 2), ("s",))
    assert event.block_hashes[0] != h((1, 2))[0]
    lora = c.admit(1, [1, 2, 3, 4, 5], 5, lora_name="L", cache_salt="s")
    assert lora is not None
    assert lora.num_hit_blocks == 0  # the adapter is part of the hash
    [event] = lora.events
    assert isinstance(event, BlockStored)
    assert event.lora_name == "L"
    assert event.extra_keys == (("L", "s"), ("L",))
    plain = c.admit(2, [1, 2, 3, 4, 5], 5)
    assert plain is not None
    assert plain.num_hit_blocks == 0


def test_a_block_computed_by_two_running_requests_is_cached_once() -> None:
    # A (prompt 1-4, answer 5-8) runs; B's prompt is A's prompt and answer, so B caches
    # block (5, 6) itself; when A finishes, that block is shared, not stored again, and
    # the run after it is stored with the right parent.
    c = cache(capacity=12)
    a = c.admit(0, [1, 2, 3, 4], 10)
    assert a is not None
    b = c.admit(1, [1, 2, 3, 4, 5, 6, 9], 8)
    assert b is not None and b.num_hit_blocks == 2
    events = c.finish(0, [1, 2, 3, 4, 5, 6, 7, 8, 0, 0])
    c.check()
    assert events == [
        BlockStored(
            block_hashes=tuple(h((1, 2), (3, 4), (5, 6), (7, 8), (0, 0))[3:]),
            parent_hash=h((1, 2), (3, 4), (5, 6))[-1],
            token_ids=(7, 8, 0, 0),
            block_size=2,
            tier=Tier.GPU,
        )
    ]
    c.release(0)
    c.release(1)
    c.check()
    assert c.num_cached_blocks == 5


def test_none_hash_is_seeded_or_random() -> None:
    assert none_hash(0) == none_hash(0) != none_hash(1)
    assert none_hash(None) != none_hash(None)


def test_random_workload_keeps_invariants_and_the_index_agrees() -> None:
    """Events applied by the real ingest path leave the index holding exactly the cache's
    blocks, and the index predicts every admission's hits."""
    rng = random.Random(5)
    c = BlockCache(12, 4, ROOT)
    index, stream = MemoryIndex(), StreamId("r1")
    ingestor = Ingestor(index)
    seq = 0

    def apply(events: list[Event]) -> None:
        nonlocal seq
        ingestor.apply(stream, "m", EventBatch(seq, time.time(), 0, events))
        seq += 1

    prefixes = [[rng.randrange(100) for _ in range(12)] for _ in range(3)]
    for request_id in range(200):
        prompt = [*rng.choice(prefixes)[: rng.randrange(1, 13)], rng.randrange(100)]
        keys = block_keys("m", prompt, 4)
        predicted = index.longest_prefix(keys, [stream])[stream].num_blocks
        admission = c.admit(request_id, prompt, len(prompt) + 3)
        assert admission is not None
        assert admission.num_hit_blocks == min(predicted, (len(prompt) - 1) // 4)
        apply(admission.events)
        apply(c.finish(request_id, [*prompt, 1, 2, 3]))
        c.release(request_id)
        c.check()
        assert index.stats(stream).num_blocks == c.num_cached_blocks


def test_service_times_and_result_arithmetic() -> None:
    assert service_times(1000, 10, 2000.0, 50.0) == (0.5, 0.2)
    result = SimResult([], [], 32, queue_s=1.0, prefill_s=0.5, decode_s=0.2)
    assert result.ttft_s == 1.5
    assert result.latency_s == pytest.approx(1.7)


def test_toy_tokenizer_is_deterministic_and_chat_renders_every_message() -> None:
    assert tokenize_text("a b  c") == tokenize_text(" a b c ") != tokenize_text("a c b")
    assert all(0 <= t < 50_000 for t in tokenize_text("hello world again"))
    text = render_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert text == "<|system|> S <|user|> U <|assistant|>"


def test_settings_are_validated() -> None:
    with pytest.raises(ReplicaSimError, match="capacity_blocks"):
        ReplicaSimSettings(capacity_blocks=0)
    with pytest.raises(ReplicaSimError, match="speed"):
        ReplicaSimSettings(speed=0)
    with pytest.raises(ReplicaSimError, match="encoding"):
        ReplicaSimSettings(encoding="json")  # type: ignore[arg-type]
    assert ReplicaSimSettings(id="r9", model="M").topic == "kv@r9@M"


def engine(**changes: object) -> tuple[Engine, list[list[Event]]]:
    settings = ReplicaSimSettings(**{"block_size": 2, "capacity_blocks": 16, **changes})  # type: ignore[arg-type]
    batches: list[list[Event]] = []
    return Engine(settings, BlockCache(16, 2, ROOT), batches.append), batches


def test_engine_queues_beyond_max_running_and_reports_times() -> None:
    eng, batches = engine(max_running=1, prefill_tps=10.0, decode_tps=10.0, speed=100.0)

    async def two() -> tuple[SimResult, SimResult, int]:
        first = asyncio.create_task(eng.run(SimRequest([1, 2, 3, 4, 5], 2)))
        await asyncio.sleep(0)
        second = asyncio.create_task(eng.run(SimRequest([1, 2, 3, 4, 6], 2)))
        await asyncio.sleep(0)
        waiting = eng.num_waiting
        return await first, await second, waiting

    first, second, waiting = asyncio.run(two())
    assert waiting == 1
    assert (first.cached_tokens, second.cached_tokens) == (0, 4)
    assert first.prefill_s == pytest.approx(0.5) and first.decode_s == pytest.approx(0.2)
    assert second.prefill_s == pytest.approx(0.1)
    assert first.queue_s < 0.05  # admitted at once (only the admission itself is timed)
    assert second.queue_s >= 0.6  # waited for the first (0.7 simulated s, minus timer slack)
    assert eng.counters.num_running == 0 and eng.counters.num_finished == 2
    assert eng.counters.num_prompt_tokens_hit == 4
    assert len(batches) == 3  # the second admission was all hits: nothing new to store
    eng.cache.check()


def test_engine_refuses_requests_longer_than_max_model_len() -> None:
    eng, _ = engine(capacity_blocks=2)
    with pytest.raises(ReplicaSimError, match="max_model_len=4"):
        asyncio.run(eng.run(SimRequest([1, 2, 3, 4], 1)))
    with pytest.raises(ReplicaSimError):
        asyncio.run(eng.run(SimRequest([], 1)))


def decoded(response: Response) -> Any:
    return json.loads(bytes(response.body))


def test_handlers_answer_like_vllm() -> None:
    eng, _ = engine(model="M", speed=1000.0, lora_names=("L",))
    body = json.dumps({"model": "M", "prompt": "a b c d e", "max_tokens": 3}).encode()
    first = decoded(asyncio.run(handle_completion(eng, body)))
    again = decoded(asyncio.run(handle_completion(eng, body)))
    assert first["object"] == "text_completion"
    assert first["usage"]["prompt_tokens"] == 5 and first["usage"]["total_tokens"] == 8
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 4
    assert again["kvsim"]["cached_tokens"] == 4
    assert len(first["choices"][0]["text"].split()) == 3
    unknown = json.dumps({"model": "X", "prompt": "a"}).encode()
    assert asyncio.run(handle_completion(eng, unknown)).status_code == 404
    assert asyncio.run(handle_completion(eng, b"{")).status_code == 400
    tok = decoded(handle_tokenize(eng.settings, b'{"model":"M","prompt":"a b"}'))
    assert tok == {"count": 2, "max_model_len": 32, "tokens": tokenize_text("a b")}
    chat = b'{"model":"M","messages":[{"role":"user","content":"hi"}]}'
    assert decoded(handle_tokenize(eng.settings, chat))["count"] == 3
    text = metrics_text(eng)
    assert 'vllm:kv_cache_usage_perc{model_name="M"}' in text
    assert 'vllm:prefix_cache_hits_total{model_name="M"} 4.0' in text


def test_metrics_parse_with_the_indexers_own_scraper() -> None:
    eng, _ = engine(model="M", speed=1000.0)
    asyncio.run(eng.run(SimRequest([1, 2, 3, 4, 5], 3)))
    load = parse_vllm_metrics(metrics_text(eng), now=1.0, model="M")
    assert (load.running, load.waiting) == (0, 0)
    assert load.kv_usage == 0.0
