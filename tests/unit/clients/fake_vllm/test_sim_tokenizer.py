"""The replica simulator with a real ``tokenizer.json`` (``--tokenizer``): its answers agree
with kvindex's local tokenizer of the same files, as vLLM's with HF's."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi import Response

from kvindex.api.tokenize.local import LocalTokenizer
from kvindex.clients.fake_vllm.block_pool import BlockPool
from kvindex.clients.fake_vllm.replica import (
    Engine,
    ReplicaSimError,
    ReplicaSimSettings,
    handle_completion,
)
from kvindex.clients.fake_vllm.token_routes import (
    handle_tokenize,
)
from tests.support.tokenizer_kinds import write_model

MESSAGES = [
    {"role": "system", "content": "answer the customer"},
    {"role": "user", "content": "refund my order please"},
]


def _decoded(response: Response) -> Any:
    return json.loads(bytes(response.body))


@pytest.mark.parametrize("kind", ["byte_level_bpe", "word_level"])
def test_the_sim_tokenizes_as_the_local_tokenizer(tmp_path: Path, kind: str) -> None:
    path = write_model(tmp_path, kind)
    settings = ReplicaSimSettings(model="M", speed=1e6, tokenizer=str(path))
    eng = Engine(settings, BlockPool(1024, 16, 7), lambda _: None)
    local = LocalTokenizer.from_files(path)
    ids = asyncio.run(local.encode_messages(MESSAGES))
    chat = json.dumps({"model": "M", "messages": MESSAGES, "max_tokens": 1}).encode()
    answer = _decoded(asyncio.run(handle_completion(eng, chat, chat=True)))
    assert answer["usage"]["prompt_tokens"] == len(ids)
    tokenized = _decoded(handle_tokenize(settings, chat))
    assert tokenized["tokens"] == ids
    prompt = json.dumps({"model": "M", "prompt": "the order"}).encode()
    assert _decoded(handle_tokenize(settings, prompt))["tokens"] == asyncio.run(
        local.encode_prompt("the order")
    )


def test_an_unreadable_tokenizer_or_a_lone_template_is_refused(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{")
    with pytest.raises(ReplicaSimError, match="tokenizer"):
        ReplicaSimSettings(tokenizer=str(tmp_path / "tokenizer.json"))
    with pytest.raises(ReplicaSimError, match="chat_template needs tokenizer"):
        ReplicaSimSettings(chat_template=str(tmp_path / "t.jinja"))


def test_a_message_the_template_refuses_is_a_400(tmp_path: Path) -> None:
    path = write_model(tmp_path, "word_level")
    template = tmp_path / "strict.jinja"
    template.write_text("{{ raise_exception('no roles here') }}")
    settings = ReplicaSimSettings(model="M", tokenizer=str(path), chat_template=str(template))
    body = json.dumps({"model": "M", "messages": MESSAGES}).encode()
    refused = handle_tokenize(settings, body)
    assert refused.status_code == 400 and b"no roles here" in bytes(refused.body)
    eng = Engine(settings, BlockPool(1024, 16, 7), lambda _: None)
    assert asyncio.run(handle_completion(eng, body, chat=True)).status_code == 400
