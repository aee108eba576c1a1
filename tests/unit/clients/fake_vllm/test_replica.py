"""The replica simulator without sockets: time model, engine, handlers (the pool has its own
tests)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fastapi import Response
from fastapi.responses import StreamingResponse
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from kvindex.api.load.vllm_metrics import parse_vllm_metrics
from kvindex.clients.fake_vllm.answers import SimResult
from kvindex.clients.fake_vllm.block_pool import BlockPool
from kvindex.clients.fake_vllm.replica import (
    Engine,
    ReplicaSimError,
    ReplicaSimSettings,
    SimRequest,
    handle_cached,
    handle_completion,
    metrics_text,
    service_times,
)
from kvindex.clients.fake_vllm.token_routes import (
    handle_embeddings,
    handle_tokenize,
)
from kvindex.clients.fake_vllm.tokenizer import (
    render_chat,
    tokenize_text,
)
from kvindex.indexer.domain.events import Event

ROOT = 7


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
    return Engine(settings, BlockPool(16, 2, ROOT), batches.append), batches


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


def test_cached_reads_the_pool_without_changing_it() -> None:
    eng, batches = engine(model="M", speed=1000.0)
    body = json.dumps({"model": "M", "prompt": "a b c d e", "max_tokens": 3}).encode()
    asyncio.run(handle_completion(eng, body))  # 5 + 3 tokens: 4 full blocks of 2 cached
    num_batches, num_pool = len(batches), eng.cache.num_cached_blocks
    prompts = ["a b c d e", "a b x y", "z", tokenize_text("a b c")]
    answer = decoded(handle_cached(eng, json.dumps({"prompts": prompts}).encode()))
    assert answer == {"num_cached_blocks": [2, 1, 0, 1], "num_pool_blocks": num_pool == 4 and 4}
    assert (len(batches), eng.cache.num_cached_blocks) == (num_batches, num_pool)
    assert handle_cached(eng, b'{"prompt": "a"}').status_code == 400


def test_send_limits_are_validated() -> None:
    for name in ("send_hwm", "send_buffer_bytes"):
        with pytest.raises(ReplicaSimError, match=name):
            ReplicaSimSettings(**{name: -1})  # type: ignore[arg-type]


def _events(response: Response) -> list[bytes]:
    """The server-sent events of a streamed answer, read whole."""
    assert isinstance(response, StreamingResponse)

    async def read() -> list[bytes]:
        return [bytes(c) async for c in response.body_iterator]  # type: ignore[arg-type]

    return asyncio.run(read())


def test_chat_renders_the_whole_conversation_and_both_routes_stream() -> None:
    eng, _ = engine(model="M", speed=1000.0)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b"}]
    chat_body = json.dumps({"model": "M", "messages": messages, "max_tokens": 3}).encode()
    chat = decoded(asyncio.run(handle_completion(eng, chat_body, chat=True)))
    assert chat["object"] == "chat.completion"
    assert chat["usage"]["prompt_tokens"] == len(tokenize_text(render_chat(messages)))
    words = chat["choices"][0]["message"]["content"].split()
    assert chat["choices"][0]["message"]["role"] == "assistant" and len(words) == 3
    streamed_body = json.dumps({"model": "M", "messages": messages, "stream": True}).encode()
    events = _events(asyncio.run(handle_completion(eng, streamed_body, chat=True)))
    assert events[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("usage" not in c for c in chunks)  # not asked for (stream_options)
    assert len(chunks) == 16  # one per word (max_tokens defaults to 16)
    prompt_body = json.dumps({"model": "M", "prompt": "a b c", "stream": True}).encode()
    plain = _events(asyncio.run(handle_completion(eng, prompt_body)))
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in plain[:-1])
    again = decoded(
        asyncio.run(handle_completion(eng, b'{"model":"M","prompt":"a b c","max_tokens":16}'))
    )
    assert text == again["choices"][0]["text"]


def test_test_knobs_fail_a_completion_and_embeddings_answer_like_openai() -> None:
    with pytest.raises(ReplicaSimError, match="fail_status"):
        ReplicaSimSettings(fail_status=200)
    with pytest.raises(ReplicaSimError, match="stream_stall_s"):
        ReplicaSimSettings(stream_stall_s=-1)
    eng, batches = engine(model="M", speed=1000.0, fail_status=429)
    body = json.dumps({"model": "M", "prompt": "a b c d e", "max_tokens": 3}).encode()
    failed = asyncio.run(handle_completion(eng, body))
    assert failed.status_code == 429 and batches == []  # refused before running
    both = decoded(handle_embeddings(eng.settings, b'{"model":"M","input":["a b","a b c"]}'))
    assert [d["index"] for d in both["data"]] == [0, 1]
    assert both["usage"]["prompt_tokens"] == 5
    vector = both["data"][0]["embedding"]
    assert len(vector) == 8 and sum(x * x for x in vector) == pytest.approx(1.0)
    assert handle_embeddings(eng.settings, b'{"model":"X","input":"a"}').status_code == 404


def test_events_bind_by_vllms_rule_unless_told() -> None:
    def bound(events: str | None, bind_events: bool | None = None) -> bool:
        return ReplicaSimSettings(events=events, bind_events=bind_events).events_bound

    assert bound(None) and bound("tcp://*:5557") and bound("tcp://[::]:5557")
    assert bound("ipc:///tmp/kv") and bound("inproc://kv")
    assert not bound("tcp://127.0.0.1:5557")  # connects: the subscriber has bound
    assert bound("tcp://127.0.0.1:5557", bind_events=True)


# --- usage, as vLLM reports it ------------------------------------------------------------


def _completion(eng: Engine, prompt: str, **fields: object) -> Response:
    body = json.dumps({"model": "M", "prompt": prompt, "max_tokens": 2, **fields}).encode()
    return asyncio.run(handle_completion(eng, body))


def test_usage_reports_the_prefix_cache_hit_in_whole_blocks_parsed_by_openai() -> None:
    eng, _ = engine(model="M", speed=1000.0)  # 2 tokens a block
    prompt = " ".join(f"w{i}" for i in range(9))
    first = Completion.model_validate(decoded(_completion(eng, prompt)))
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert (first.usage.prompt_tokens, first.usage.prompt_tokens_details.cached_tokens) == (9, 0)
    # 10 tokens, 5 blocks: the first 4 were cached by the first request, its 5th differs
    again = Completion.model_validate(decoded(_completion(eng, prompt + " x")))
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (again.usage.prompt_tokens, again.usage.prompt_tokens_details.cached_tokens) == (10, 8)
    whole = Completion.model_validate(decoded(_completion(eng, prompt + " x")))
    assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
    assert whole.usage.prompt_tokens_details.cached_tokens == 8  # the last block is computed
    assert whole.usage.completion_tokens == 2 and whole.usage.total_tokens == 12


def test_without_prompt_tokens_details_usage_has_only_the_counts() -> None:
    eng, _ = engine(model="M", speed=1000.0, enable_prompt_tokens_details=False)
    answer = decoded(_completion(eng, "a b c"))
    assert "prompt_tokens_details" not in answer["usage"]
    parsed = Completion.model_validate(answer)
    assert parsed.usage is not None and parsed.usage.prompt_tokens_details is None
    assert parsed.usage.prompt_tokens == 3


def test_a_stream_carries_usage_in_a_last_chunk_only_when_asked() -> None:
    eng, _ = engine(model="M", speed=1000.0, block_size=2)
    messages = [{"role": "user", "content": "a b c d e"}]
    body: dict[str, object] = {"model": "M", "messages": messages, "max_tokens": 3, "stream": True}
    asyncio.run(handle_completion(eng, json.dumps(body).encode(), chat=True))  # now cached
    asked = body | {"stream_options": {"include_usage": True}}
    events = _events(asyncio.run(handle_completion(eng, json.dumps(asked).encode(), chat=True)))
    chunks = [ChatCompletionChunk.model_validate_json(e[6:]) for e in events[:-1]]
    assert [c.usage is None for c in chunks] == [True, True, True, False]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == len(tokenize_text(render_chat(messages)))
    assert last.usage.prompt_tokens_details is not None
    cached = last.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached > 0 and cached % 2 == 0
    unasked = body | {"stream_options": {"include_usage": False}}
    events = _events(asyncio.run(handle_completion(eng, json.dumps(unasked).encode(), chat=True)))
    assert all(b'"usage"' not in e for e in events) and len(events) == 3 + 1
    plain = _events(_completion(eng, "a b c", stream=True, stream_options={"include_usage": True}))
    usage_chunk = Completion.model_validate_json(plain[-2][6:])
    assert usage_chunk.usage is not None and usage_chunk.usage.prompt_tokens == 3


def test_stream_options_without_a_stream_are_refused_as_vllm_does() -> None:
    eng, _ = engine(model="M", speed=1000.0)
    refused = _completion(eng, "a b", stream_options={"include_usage": True})
    assert refused.status_code == 400
    chat = ChatCompletion.model_validate(
        decoded(
            asyncio.run(
                handle_completion(
                    eng,
                    json.dumps(
                        {"model": "M", "messages": [{"role": "user", "content": "a"}]}
                    ).encode(),
                    chat=True,
                )
            )
        )
    )
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
