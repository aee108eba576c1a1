"""bench/replay_tokenizer.py: its tokenizer.json encodes the replay's prompts as the
replay's fake workers tokenize them."""

from __future__ import annotations

import hashlib
import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest
import tokenizers

from tests.support.paths import ROOT

BLOCK_CHARS = 64
TOKENS_PER_BLOCK = 16


def _bench_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "replay_tokenizer", ROOT / "bench" / "replay_tokenizer.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("replay_tokenizer", module)
    spec.loader.exec_module(module)
    return module


def block_text(block_id: int) -> str:
    """A replay block (the replay's docstring: ``sha256(str(h)).hexdigest()[:56]`` and the
    id as eight hex digits): 64 lowercase hex characters."""
    return hashlib.sha256(str(block_id).encode()).hexdigest()[:56] + f"{block_id:08x}"


def worker_tokens(text: str) -> list[int]:
    """The workers' rule on a prompt of whole blocks (the replay's ``text_tokens``): 16 tokens
    a 64-character block, ``int(group, 16) + 1`` for each group of four hex digits."""
    assert len(text) % BLOCK_CHARS == 0
    return [int(text[i : i + 4], 16) + 1 for i in range(0, len(text), 4)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tokenizers.Tokenizer:
    """The tokenizer as the script writes it, read back from its file."""
    path = Path(tmp_path_factory.mktemp("replay")) / "tokenizer.json"
    _bench_module().replay_tokenizer().save(str(path))
    return tokenizers.Tokenizer.from_file(str(path))


def test_encoding_equals_the_workers_on_generated_prompts(saved: tokenizers.Tokenizer) -> None:
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(2**32) for _ in range(rng.randrange(1, 40))]
        prompt = "".join(block_text(i) for i in ids)
        encoded = saved.encode(prompt)  # special tokens added as kvindex asks: none exist
        assert encoded.ids == worker_tokens(prompt)
        assert len(encoded.ids) == TOKENS_PER_BLOCK * len(ids)


def test_every_group_has_its_value_plus_one(saved: tokenizers.Tokenizer) -> None:
    every_group = "".join(f"{value:04x}" for value in range(16**4))
    assert saved.encode(every_group).ids == list(range(1, 16**4 + 1))


def test_other_text_is_unknown(saved: tokenizers.Tokenizer) -> None:
    assert saved.encode("warm up").ids == [0, 0]
    assert saved.encode("ABCD").ids == [0]
