"""bench/picker.py's ``turns`` mode: each request is its conversation's last one plus an
assistant answer and a user question, which the picker's local tokenizer encodes from the kept
prefix (the ids equal the whole text's)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from kvindex.api.tokenize.local import LocalTokenizer, encode_whole
from tests.support.paths import ROOT


def _bench_module() -> ModuleType:
    sys.path.insert(0, str(ROOT / "bench"))  # its own imports (machine)
    spec = importlib.util.spec_from_file_location("bench_picker", ROOT / "bench" / "picker.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_picker", module)
    spec.loader.exec_module(module)
    return module


def test_each_turn_extends_its_conversation(tmp_path: Path) -> None:
    bench = _bench_module()
    first, later = bench._turns(bench._tokenizer(tmp_path), 400, 2, 3)
    assert len(first) == 2 and len(later) == 6
    previous = [json.loads(body)["messages"] for body in first]
    for n, body in enumerate(later):
        messages = json.loads(body)["messages"]
        before = previous[n % 2]
        assert messages[: len(before)] == before
        assert [m["role"] for m in messages[len(before) :]] == ["assistant", "user"]
        previous[n % 2] = messages


def test_a_next_turn_is_encoded_from_the_kept_prefix(tmp_path: Path) -> None:
    bench = _bench_module()
    first, later = bench._turns(bench._tokenizer(tmp_path), 400, 2, 2)
    local = LocalTokenizer.from_files(tmp_path / "model" / "tokenizer.json")

    async def encode(body: bytes) -> list[int]:
        return await local.encode_messages(json.loads(body)["messages"])

    for body in first:
        asyncio.run(encode(body))
    assert local.num_reused == 0
    for body in later:
        ids = asyncio.run(encode(body))
        assert local.chat_template is not None
        text = local.chat_template.render(json.loads(body)["messages"])
        assert ids == encode_whole(local.tokenizer, text, False)
    assert local.num_reused == len(later)
