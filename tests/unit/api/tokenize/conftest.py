"""Fixtures of the tokenizer tests: the tiny model, and a directory laid out like HF's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers

from tests.unit.api.tokenize.samples import BOS, CHAT_TEMPLATE, EOS, make_tokenizer


@pytest.fixture
def raw() -> tokenizers.Tokenizer:
    return make_tokenizer()


@pytest.fixture
def model_dir(tmp_path: Path, raw: tokenizers.Tokenizer) -> Path:
    """tokenizer.json + tokenizer_config.json (template, BOS as an AddedToken dict)."""
    raw.save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "bos_token": {"content": BOS}, "eos_token": EOS}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path
