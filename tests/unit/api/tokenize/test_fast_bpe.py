"""kvindex.api.tokenize.fast_bpe: tiktoken's encoder gives a byte-level BPE tokenizer's own ids,
or declines; the shapes it does not reproduce get no fast path."""

from __future__ import annotations

import asyncio
import json
import logging
from functools import cache

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers

from kvindex.api.tokenize import fast_bpe
from kvindex.api.tokenize.fast_bpe import FastBpe
from kvindex.api.tokenize.local import CHECK_EVERY, LocalTokenizer
from kvindex.api.tokenize.split_points import CJK_PUNCTUATION
from tests.support.tokenizer_kinds import KINDS, MASK, WORDS

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CORPUS = [
    " ".join(WORDS[i : i + 9]) + f" {i} {i * 37}\n\tx = f({i});  # é漢Ü 'll 'S" for i in range(300)
]


def _trained(pre: pre_tokenizers.PreTokenizer, **model: object) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE(**model))  # type: ignore[arg-type]
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS, trainer)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.add_tokens([tokenizers.AddedToken(MASK, lstrip=True, special=True, normalized=False)])
    return tok


@cache
def _gpt2_like() -> tokenizers.Tokenizer:
    return KINDS["byte_level_bpe"]()[0]


@cache
def _llama3_like() -> tokenizers.Tokenizer:
    split = pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False)
    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return _trained(pre_tokenizers.Sequence([split, level]))


@cache
def _nfc() -> tokenizers.Tokenizer:
    tok = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False))
    tok.normalizer = normalizers.NFC()
    return tok


_SHAPES = {"gpt2": _gpt2_like, "llama3": _llama3_like, "nfc": _nfc}
_PIECES = [
    *WORDS[:20], " ", "  ", "   ", "\n", "\r\n", "\n\n", "\t", " \n ", "é", "e\u0301", "漢", "Ü",
    "ﬁ", "🙂", "'s", "'LL", "'re", "123", "4567", ".", "...", "!?", "\u00a0", "\u2003",
    "<|im_start|>", "<|im_end|>", "<|im_", MASK, " " + MASK, "\ud800", "你好", "\uff0c", "。」",
]  # fmt: skip
_texts = st.one_of(
    st.lists(st.sampled_from(_PIECES), max_size=30).map("".join),
    st.text(max_size=60),
)


@pytest.mark.parametrize("shape", sorted(_SHAPES))
@settings(max_examples=150, deadline=None)
@given(text=_texts)
def test_fast_ids_equal_the_tokenizers_own(shape: str, text: str) -> None:
    """On any text the fast path answers the tokenizer's own ids without special tokens
    added, or None; None only for what the module says it leaves to the tokenizer."""
    tok = _SHAPES[shape]()
    fast = FastBpe.of(tok)
    assert fast is not None
    ids = fast.encode(text)
    try:
        expected = tok.encode(text, add_special_tokens=False).ids
    except Exception:  # the tokenizer refuses an unpaired surrogate: so must the fast path
        assert ids is None
        return
    if ids is None:
        assert MASK in text or "\ud800" in text or shape == "nfc"
    else:
        assert ids == expected


@pytest.mark.parametrize("name", ["metaspace_bpe", "prepend_bpe", "word_level"])
def test_other_shapes_get_no_fast_path(name: str) -> None:
    assert FastBpe.of(KINDS[name]()[0]) is None


def test_a_tokenizer_whose_ids_do_not_follow_its_merges_gets_none() -> None:
    tok = _gpt2_like()
    config = tok.to_str()
    # Swap the ids of the first and the last merged tokens: the ranks no longer follow.
    data = json.loads(config)
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    first, last = (
        "".join(m.split(" ")) if isinstance(m, str) else "".join(m) for m in (merges[0], merges[-1])
    )
    vocab[first], vocab[last] = vocab[last], vocab[first]
    assert FastBpe.of(tokenizers.Tokenizer.from_str(json.dumps(data))) is None


@pytest.mark.parametrize(
    "pre",
    [
        pre_tokenizers.ByteLevel(add_prefix_space=True),
        pre_tokenizers.Whitespace(),
        pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.ByteLevel()]),
    ],
)
def test_pre_tokenizers_it_does_not_reproduce_get_none(pre: pre_tokenizers.PreTokenizer) -> None:
    tok = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False))
    tok.pre_tokenizer = pre
    assert FastBpe.of(tok) is None


def test_dropout_gets_none() -> None:
    assert (
        FastBpe.of(_trained(pre_tokenizers.ByteLevel(add_prefix_space=False), dropout=0.1)) is None
    )


def test_a_fast_path_that_differs_on_the_sample_is_not_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fast_bpe, "GPT2_PATTERN", r"\S+|\s+")  # a wrong split of the text
    with caplog.at_level(logging.WARNING):
        assert FastBpe.of(_gpt2_like()) is None
    assert "differs" in caplog.text


def test_a_mismatch_at_run_time_drops_the_fast_path(caplog: pytest.LogCaptureFixture) -> None:
    """One text in CHECK_EVERY is also encoded by the tokenizer; the first mismatch drops
    the fast path (logged, counted) and that text's ids are the tokenizer's."""
    tok = KINDS["byte_level_bpe"]()[0]
    local = LocalTokenizer(tok, prefix_cache_bytes=0)
    assert local.fast is not None

    class Wrong:
        def encode(self, text: str) -> list[int]:
            return [1, 2, 3]

    local.fast = Wrong()  # type: ignore[assignment]
    with caplog.at_level(logging.ERROR):
        ids = asyncio.run(local.encode_prompt("hello there"))
    assert ids == tok.encode("hello there").ids
    assert (local.fast, local.num_fast_mismatches) == (None, 1)
    assert "differed" in caplog.text
    assert CHECK_EVERY > 1


@pytest.mark.parametrize("shape", sorted(_SHAPES))
@settings(max_examples=150, deadline=None)
@given(text=_texts)
def test_split_encodes_equal_the_whole(shape: str, text: str) -> None:
    """At every split point the two sides encoded apart are the whole text's ids."""
    tok = _SHAPES[shape]()
    fast = FastBpe.of(tok)
    assert fast is not None and fast.splits.words and fast.splits.punctuation
    whole = fast.encode(text)
    if whole is None:
        return
    assert whole == tok.encode(text, add_special_tokens=False).ids
    at = fast.split_point(text, 0)
    while at is not None:
        assert text[at - 1].isalpha()
        assert text[at] in CJK_PUNCTUATION or (text[at] == " " and text[at + 1].isalpha())
        assert (fast.encode(text[:at]) or []) + (fast.encode(text[at:]) or []) == whole
        at = fast.split_point(text, at + 1)


def test_a_regex_that_keeps_spaces_with_words_is_not_split() -> None:
    """A ``Split`` regex whose pieces end in a space: the fast path encodes, but its sample's
    splits differ from the whole, so texts are never split."""
    split = pre_tokenizers.Split(Regex(r"\S+ ?|\s+"), behavior="isolated", invert=False)
    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    fast = FastBpe.of(_trained(pre_tokenizers.Sequence([split, level])))
    assert fast is not None
    assert not fast.splits.words
    assert fast.split_point("hello brave new world", 0) is None


def test_an_added_token_with_a_space_turns_splits_off() -> None:
    tok = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False))
    tok.add_special_tokens(["<|a b|>"])
    fast = FastBpe.of(tok)
    assert fast is not None and not fast.splits.words
