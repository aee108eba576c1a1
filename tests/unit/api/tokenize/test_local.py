"""kvindex.api.tokenize.local: LocalTokenizer on a tiny model directory."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import tokenizers

from kvindex.api.tokenize.local import LocalTokenizer
from kvindex.api.tokenize.protocol import TokenizerError
from tests.unit.api.tokenize.samples import (
    BOS,
    CONVERSATION,
    CORPUS,
    EOS,
    SYSTEM,
    contains,
    make_tokenizer,
    token_id,
    words,
)


def test_prompt_gets_one_bos(model_dir: Path, raw: tokenizers.Tokenizer) -> None:
    tok = LocalTokenizer.from_files(model_dir / "tokenizer.json")
    ids = asyncio.run(tok.encode_prompt("the quick brown fox"))
    bos = token_id(raw, BOS)
    assert ids == [bos, *words(raw, "the quick brown fox")]
    assert ids.count(bos) == 1


def test_messages_render_the_whole_conversation(model_dir: Path, raw: tokenizers.Tokenizer) -> None:
    tok = LocalTokenizer.from_files(model_dir / "tokenizer.json")
    ids = asyncio.run(tok.encode_messages(CONVERSATION))
    assert contains(ids, words(raw, SYSTEM))  # the first message
    assert contains(ids, words(raw, CONVERSATION[-1]["content"]))  # and the last one
    assert contains(ids, words(raw, CONVERSATION[2]["content"]))
    assert ids.count(token_id(raw, "<|user|>")) == 2
    assert ids[-1] == token_id(raw, "<|assistant|>")  # the generation prompt


def test_messages_bos_is_not_doubled(model_dir: Path, raw: tokenizers.Tokenizer) -> None:
    tok = LocalTokenizer.from_files(model_dir / "tokenizer.json")
    ids = asyncio.run(tok.encode_messages(CONVERSATION))
    bos = token_id(raw, BOS)
    assert ids[0] == bos
    assert ids.count(bos) == 1


def test_messages_equal_hf_rendering_encoded_without_specials(
    model_dir: Path, raw: tokenizers.Tokenizer
) -> None:
    tok = LocalTokenizer.from_files(model_dir / "tokenizer.json")
    expected_text = (
        f"{BOS}<|system|> {SYSTEM} {EOS}\n"
        "<|user|> what is the capital of france </s>\n"
        "<|assistant|> paris </s>\n"
        "<|user|> and what about germany then </s>\n"
        "<|assistant|>"
    )
    assert tok.chat_template is not None
    assert tok.chat_template.render(CONVERSATION) == expected_text
    assert asyncio.run(tok.encode_messages(CONVERSATION)) == words(raw, expected_text)


def test_without_template_messages_fail_prompts_work(tmp_path: Path) -> None:
    make_tokenizer().save(str(tmp_path / "tokenizer.json"))
    tok = LocalTokenizer.from_files(tmp_path / "tokenizer.json")
    assert tok.chat_template is None
    with pytest.raises(TokenizerError, match="no chat template"):
        asyncio.run(tok.encode_messages(CONVERSATION))
    assert len(asyncio.run(tok.encode_prompt("paris"))) == 2


@pytest.mark.parametrize("content", ["{ not json", "", "\x00\x01garbage"])
def test_broken_tokenizer_file(tmp_path: Path, content: str) -> None:
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(TokenizerError, match=r"tokenizer file .*tokenizer\.json"):
        LocalTokenizer.from_files(tmp_path / "tokenizer.json")


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="unreadable"):
        LocalTokenizer.from_files(tmp_path / "nope.json")


def test_template_raise_exception_is_a_tokenizer_error(model_dir: Path) -> None:
    tok = LocalTokenizer.from_files(model_dir / "tokenizer.json")
    with pytest.raises(TokenizerError, match="unknown role robot"):
        asyncio.run(tok.encode_messages([{"role": "robot", "content": "hi"}]))


def test_template_failing_on_input_is_a_tokenizer_error(model_dir: Path) -> None:
    tok = LocalTokenizer.from_files(model_dir / "tokenizer.json")
    with pytest.raises(TokenizerError, match="chat template"):
        asyncio.run(tok.encode_messages([{"content": "no role"}]))


def test_long_text_off_loop_equals_inline(model_dir: Path) -> None:
    text = " ".join(CORPUS * 200)
    inline = LocalTokenizer.from_files(model_dir / "tokenizer.json")
    inline.inline_max_chars = len(text)
    threaded = LocalTokenizer.from_files(model_dir / "tokenizer.json")
    threaded.inline_max_chars = 0
    assert asyncio.run(threaded.encode_prompt(text)) == asyncio.run(inline.encode_prompt(text))
    assert asyncio.run(threaded.encode_messages(CONVERSATION)) == asyncio.run(
        inline.encode_messages(CONVERSATION)
    )
