"""kvindex.api.tokenize.local: LocalTokenizer on a tiny model directory."""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path
from typing import Any, cast

import pytest
import tokenizers

from kvindex.api.tokenize.chat_template import ChatTemplate
from kvindex.api.tokenize.fast_bpe import FastBpe
from kvindex.api.tokenize.local import LocalTokenizer
from kvindex.api.tokenize.protocol import NO_OPTIONS, Head, TokenizerError, pack_ids
from kvindex.api.tokenize.split_points import WORDS
from tests.support.request_logs import text
from tests.support.tokenizer_kinds import KINDS
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


def _chatml() -> tuple[LocalTokenizer, tokenizers.Tokenizer]:
    tok, template, specials = KINDS["byte_level_bpe"]()
    return LocalTokenizer(tok, ChatTemplate(template, special_tokens=specials)), tok


def _long_chat(seed: int, num_words: int = 400) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {"role": "system", "content": text(rng, num_words)},
        {"role": "user", "content": text(rng, 20)},
    ]


def test_a_long_unseen_text_gets_a_head_of_its_whole_ids() -> None:
    """The head is the whole ids' start; its estimate is near their count; its rest is the
    whole ids, kept: the same text next gets them at once, and a next turn reuses them."""
    local, tok = _chatml()
    chat = _long_chat(1)
    head = asyncio.run(local.messages_head(chat, NO_OPTIONS, 256))
    assert isinstance(head, Head)
    rendered = local.chat_template.render(chat) if local.chat_template else ""
    expected = pack_ids(tok.encode(rendered, add_special_tokens=False).ids)
    assert len(head.packed) // 4 >= 16 and expected.startswith(head.packed)
    assert len(head.packed) < len(expected) // 2
    assert 0.7 < head.num_tokens / (len(expected) // 4) < 1.3
    assert asyncio.run(head.rest()) == expected
    assert asyncio.run(local.messages_head(chat, NO_OPTIONS, 256)) == expected
    later = [*chat, {"role": "assistant", "content": "yes"}, {"role": "user", "content": "and"}]
    assert isinstance(asyncio.run(local.messages_head(later, NO_OPTIONS, 256)), bytes)
    assert (local.num_heads, local.num_reused, local.num_head_mismatches) == (1, 2, 0)


@pytest.mark.parametrize("fast", [True, False])
def test_short_texts_get_their_whole_ids_long_ones_a_head_with_or_without_the_fast_path(
    fast: bool,
) -> None:
    tok, template, specials = KINDS["byte_level_bpe"]()
    local = LocalTokenizer(tok, ChatTemplate(template, special_tokens=specials), fast=fast)
    whole = LocalTokenizer(tok, ChatTemplate(template, special_tokens=specials), fast=False)
    short, long = _long_chat(2, 20), _long_chat(3)
    got = asyncio.run(local.messages_head(short, NO_OPTIONS, 256))
    assert got == asyncio.run(whole.packed_messages(short))
    head = asyncio.run(local.messages_head(long, NO_OPTIONS, 256))
    expected = asyncio.run(whole.packed_messages(long))
    assert isinstance(head, Head) and expected.startswith(head.packed)
    assert asyncio.run(head.rest()) == expected
    prompt = asyncio.run(local.prompt_head("a short prompt", 256))
    assert prompt == pack_ids(tok.encode("a short prompt").ids)
    assert (local.num_heads, local.num_head_mismatches) == (1, 0)


def test_a_head_its_whole_ids_do_not_start_with_turns_heads_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    local, _ = _chatml()
    real = cast(FastBpe, local.fast)

    class ShortWrong:
        splits = WORDS

        def encode(self, text: str) -> list[int] | None:
            ids = real.encode(text)
            return None if ids is None else ids + [0] * (len(text) < 1024)

    local.fast = ShortWrong()  # type: ignore[assignment]
    head = asyncio.run(local.messages_head(_long_chat(3), NO_OPTIONS, 256))
    assert isinstance(head, Head)
    with caplog.at_level(logging.ERROR):
        asyncio.run(head.rest())
    assert (local.heads, local.num_head_mismatches) == (False, 1)
    assert "differed" in caplog.text
    assert isinstance(asyncio.run(local.messages_head(_long_chat(4), NO_OPTIONS, 256)), bytes)
