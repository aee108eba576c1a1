"""kvindex.api.tokenize.local's prefix reuse, .cuts and .prefix_cache: the ids of a text
encoded from a kept prefix equal its whole encode, on every tokenizer kind."""

from __future__ import annotations

import asyncio
from functools import cache
from typing import Any

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import models, pre_tokenizers, processors

from kvindex.api.tokenize import local as local_module
from kvindex.api.tokenize.chat_template import ChatTemplate
from kvindex.api.tokenize.cuts import MAX_CANDIDATES, Cuts
from kvindex.api.tokenize.local import LocalTokenizer, encode_whole, special_wrap
from kvindex.api.tokenize.prefix_cache import KeptCut, PrefixCache, entry_bytes
from kvindex.api.tokenize.protocol import Head, pack_ids, unpack_ids
from tests.support.tokenizer_kinds import KINDS, MASK, WORDS

Conversation = list[dict[str, Any]]

_PIECES = [
    *WORDS[:12], " ", "  ", "\n", "\n\n", "\t", "é", "漢", "Ü", "ﬁ", "'s", "123", ".",
    "<|im_start|>", "<|im_end|>", "[INST]", "</s>", "<s>", "<|user|>", MASK, " " + MASK,
    "你好", "天气", "\uff0c", "。", "「",
]  # fmt: skip
_content = st.lists(st.sampled_from(_PIECES), max_size=12).map("".join)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": _content}
)


@cache
def _kind(name: str) -> tuple[tokenizers.Tokenizer, ChatTemplate]:
    tok, template, special_tokens = KINDS[name]()
    return tok, ChatTemplate(template, special_tokens=special_tokens)


def _local(name: str, prefix_cache_bytes: int = 1 << 20, fast: bool = True) -> LocalTokenizer:
    tok, template = _kind(name)
    return LocalTokenizer(tok, template, prefix_cache_bytes=prefix_cache_bytes, fast=fast)


def _whole(name: str, messages: Conversation) -> list[int]:
    tok, template = _kind(name)
    return encode_whole(tok, template.render(messages), add_special_tokens=False)


def _counted(local: LocalTokenizer) -> list[int]:
    """The lengths of the texts ``local``'s fast path encodes from now on, as they come."""
    fast = local.fast
    assert fast is not None
    encoded: list[int] = []
    encode = fast.encode

    def counted(text: str) -> list[int] | None:
        encoded.append(len(text))
        return encode(text)

    fast.encode = counted  # type: ignore[method-assign]
    return encoded


@pytest.mark.parametrize("name", sorted(KINDS))
@settings(max_examples=60, deadline=None)
@given(
    conversations=st.lists(st.lists(_message, min_size=1, max_size=6), min_size=1, max_size=4),
    inline=st.booleans(),
    now=st.booleans(),
    fast=st.booleans(),
)
def test_reuse_equals_whole_encode(
    name: str, conversations: list[Conversation], inline: bool, now: bool, fast: bool
) -> None:
    """Every turn of several conversations (each growing, sharing their starts), through one
    tokenizer and its cache, equals the whole encode of its rendering (asked for at once,
    or awaited; on the loop, or in a thread; by the fast path where it applies, or not)."""
    local = _local(name, fast=fast)
    local.inline_max_chars = 1 << 20 if inline else 0
    shared = conversations[0][:1]

    async def ids(messages: Conversation) -> list[int]:
        packed = local.messages_now(messages) if now else None
        if packed is None:
            return await local.encode_messages(messages)
        return unpack_ids(packed)

    async def run() -> None:
        for conversation in conversations:
            for turn in range(1, len(conversation) + 1):
                messages = shared + conversation[:turn]
                assert await ids(messages) == _whole(name, messages)

    asyncio.run(run())


@pytest.mark.parametrize("name", sorted(KINDS))
def test_a_shared_system_prompt_is_encoded_once(name: str) -> None:
    local = _local(name)
    system = {"role": "system", "content": " ".join(WORDS * 4)}

    async def run() -> None:
        for i in range(5):
            messages = [system, {"role": "user", "content": f"question {i} {WORDS[i]}"}]
            assert await local.encode_messages(messages) == _whole(name, messages)

    asyncio.run(run())
    assert local.num_reused == 4


def test_prompts_are_reused_with_the_special_tokens_the_post_processor_adds() -> None:
    bpe, wordy = _local("byte_level_bpe"), _local("word_level")  # word_level adds a BOS
    prompts = {
        bpe: "<|im_start|>system\nthe rules<|im_end|>\n<|im_start|>user\n",
        wordy: "<|system|> the rules <|user|> ",
    }

    async def run() -> None:
        for local, prompt in prompts.items():
            for tail in ("a", "b"):
                assert await local.encode_prompt(prompt + tail) == encode_whole(
                    local.tokenizer, prompt + tail, add_special_tokens=True
                )

    asyncio.run(run())
    assert (bpe.num_reused, wordy.num_reused) == (1, 1)


_prompt = st.lists(st.sampled_from([*_PIECES, " ", " ", "a", "b"]), max_size=40).map("".join)


@pytest.mark.parametrize("name", sorted(KINDS))
@settings(max_examples=60, deadline=None)
@given(starts=st.lists(_prompt, min_size=1, max_size=3), tails=st.lists(_prompt, max_size=4))
def test_prompt_reuse_equals_whole_encode(name: str, starts: list[str], tails: list[str]) -> None:
    """Prompts growing from shared starts, cut at anchors every few characters, equal their
    whole encode with the post-processor's tokens: at once, awaited, or as a head."""
    local = _local(name)
    local.anchor_chars = 5
    tok = local.tokenizer

    async def run() -> None:
        for start in starts:
            prompt = start
            for tail in ["", *tails]:
                prompt += tail
                whole = encode_whole(tok, prompt, add_special_tokens=True)
                now = local.prompt_now(prompt)
                assert now is None or unpack_ids(now) == whole
                assert await local.encode_prompt(prompt) == whole
                head = await local.prompt_head(prompt + " x", 4)
                whole_x = encode_whole(tok, prompt + " x", add_special_tokens=True)
                if isinstance(head, bytes):
                    assert unpack_ids(head) == whole_x
                else:
                    assert unpack_ids(await head.rest()) == whole_x
                    assert whole_x[: len(head.packed) // 4] == unpack_ids(head.packed)

    asyncio.run(run())
    assert local.num_head_mismatches == 0


_CHINESE = "今天天气很好\uff0c我们去公园散步。明天呢\uff1f"  # no space between two letters


@pytest.mark.parametrize("document", [" ".join(WORDS * 40), _CHINESE * 200])
def test_a_long_prompt_is_encoded_from_its_last_anchor(document: str) -> None:
    """A prompt with no added token, its start kept: only its end is encoded again (Chinese
    prose too, cut before its punctuation)."""
    local = _local("byte_level_bpe")
    encoded = _counted(local)
    assert len(document) > 3 * local.anchor_chars

    async def run() -> None:
        for question in ("", " what does it say", " and then what"):
            prompt = document + question
            expected = encode_whole(local.tokenizer, prompt, add_special_tokens=True)
            assert await local.encode_prompt(prompt) == expected

    encoded.clear()
    asyncio.run(run())
    assert local.num_reused == 2
    first, later = encoded[: len(encoded) - 2], encoded[-2:]
    assert sum(first) >= len(document) and max(later) < local.anchor_chars + 20


@pytest.mark.parametrize("name", ["byte_level_bpe", "word_level"])
def test_anchors_that_do_not_hold_are_dropped(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Anchors inside words (a split rule gone wrong): the first prompt cut at them is checked
    whole, found to differ, and encoded without them; heads and anchors are off from then."""

    def anywhere(text: str, start: int, *_: object) -> int | None:
        return start if start < len(text) - 1 else None

    monkeypatch.setattr(local_module, "split_point", anywhere)
    local = _local(name)
    local.anchor_chars = 3
    prompt = "abcdefghij" * 10

    async def run() -> None:
        for tail in ("", "xyz"):
            expected = encode_whole(local.tokenizer, prompt + tail, add_special_tokens=True)
            assert await local.encode_prompt(prompt + tail) == expected

    asyncio.run(run())
    assert (local.heads, local.anchors, local.num_head_mismatches) == (False, False, 1)
    assert local.num_reused == 0


@pytest.mark.parametrize(
    ("name", "anchors"),
    [
        ("byte_level_bpe", True),
        ("metaspace_bpe", True),
        ("word_level", True),
        ("prepend_bpe", False),
    ],
)
def test_tokenizers_are_cut_between_words_where_their_ids_allow(name: str, anchors: bool) -> None:
    """Llama 2's shape (a normalizer prepends "▁" to every text) would encode a text's end
    apart otherwise: no anchors; the others, with or without the fast path, are cut there."""
    assert _local(name).anchors is anchors
    assert _local(name, fast=False).anchors is anchors


def test_a_long_prompt_without_the_fast_path_is_encoded_from_its_last_anchor() -> None:
    local = _local("word_level")
    assert local.fast is None and local.anchors
    document = " ".join(WORDS * 40)

    async def run() -> None:
        for question in ("", " what does it say", " and then what"):
            expected = encode_whole(local.tokenizer, document + question, add_special_tokens=True)
            assert await local.encode_prompt(document + question) == expected

    asyncio.run(run())
    assert local.num_reused == 2


@pytest.mark.parametrize(
    ("name", "before", "after"),
    [("byte_level_bpe", [], []), ("word_level", ["<s>"], []), ("metaspace_bpe", [], [])],
)
def test_the_special_tokens_around_a_prompt(name: str, before: list[str], after: list[str]) -> None:
    tok = _kind(name)[0]
    wrap = special_wrap(tok)
    ids = [unpack_ids(part) for part in wrap] if wrap is not None else None
    assert ids == [[tok.token_to_id(t) for t in before], [tok.token_to_id(t) for t in after]]


def test_the_special_tokens_around_a_prompt_when_they_close_it_or_may_be_cut() -> None:
    tok = tokenizers.Tokenizer.from_str(_kind("word_level")[0].to_str())
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    assert bos is not None and eos is not None
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", bos), ("</s>", eos)]
    )
    assert special_wrap(tok) == (pack_ids([bos]), pack_ids([eos]))
    local = LocalTokenizer(tok, prefix_cache_bytes=1 << 20)
    for prompt in ("<|system|> a rule <|user|> hi", "<|system|> a rule <|user|> ho"):
        expected = encode_whole(tok, prompt, add_special_tokens=True)
        assert asyncio.run(local.encode_prompt(prompt)) == expected
    assert local.num_reused == 1
    tok.enable_truncation(8)
    assert special_wrap(tok) is None


def test_prefix_cache_off_encodes_whole() -> None:
    local = _local("byte_level_bpe", prefix_cache_bytes=0)
    messages = [{"role": "user", "content": "hello"}]
    assert asyncio.run(local.encode_messages(messages)) == _whole("byte_level_bpe", messages)
    assert asyncio.run(local.encode_messages(messages)) == _whole("byte_level_bpe", messages)
    assert local.prefixes is None and local.num_reused == 0


def test_packed_ids_unpack_to_the_ids() -> None:
    local = _local("byte_level_bpe")
    messages = [{"role": "user", "content": "hello"}]
    packed = asyncio.run(local.packed_messages(messages))
    assert unpack_ids(packed) == _whole("byte_level_bpe", messages)


# --- cuts -----------------------------------------------------------------------------------


def test_no_cut_before_a_token_that_strips_its_left() -> None:
    tok, _ = _kind("byte_level_bpe")
    cuts = Cuts.of(tok)
    assert cuts is not None
    found = cuts.find(f"a<|im_start|>b {MASK} c<|im_end|>")
    assert [c.position for c in found] == [1, 23]
    assert found[0].token_id == tok.token_to_id("<|im_start|>")


_OVERLAPPING = {"<|a|>": 1, "|>x": 2, "<|a": 3, "<": 4, "[b]": 5, "]": 6}
"""Contents that overlap and prefix each other, three of them starting with ``<``."""
_cut_text = st.lists(
    st.sampled_from([*_OVERLAPPING, "<|", "|", "x", "a", " ", "[", "b", "漢"]), max_size=40
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_cut_text)
def test_find_equals_find_by_regex(text: str) -> None:
    """The memchr walk finds the cuts the regex's scan finds, overlaps and position 0 alike."""
    cuts = Cuts(_OVERLAPPING)
    assert cuts.find(text) == cuts.find_by_regex(text)


def test_a_text_of_many_first_characters_finds_the_same_cuts() -> None:
    """Over MAX_CANDIDATES starting characters: the regex's scan, the same answer."""
    cuts = Cuts(_OVERLAPPING)
    text = "<|a|>x[b]" * (MAX_CANDIDATES // 2)
    assert len(cuts.find(text)) == 2 * (MAX_CANDIDATES // 2) - 1
    assert cuts.find(text) == cuts.find_by_regex(text)


def test_a_truncating_tokenizer_has_no_cuts() -> None:
    tok, _, _ = KINDS["byte_level_bpe"]()
    tok.enable_truncation(16)
    assert Cuts.of(tok) is None


# --- the cache ------------------------------------------------------------------------------


def _cut(n: int) -> KeptCut:
    return KeptCut(bytes([n]) * 16, n)


def test_longest_kept_cut_wins_and_hands_out_its_prefix() -> None:
    cache = PrefixCache(1 << 20)
    cache.keep(bytes(range(40)), (_cut(2), _cut(5)))
    hit = cache.longest([_cut(2).digest, _cut(5).digest, b"x" * 16])
    assert hit is not None and hit.index == 1 and hit.packed == bytes(range(20))
    assert hit.cuts == (_cut(2), _cut(5))
    assert cache.longest([b"y" * 16]) is None


def test_cache_is_bounded_by_bytes_and_evicts_the_least_recent() -> None:
    size = entry_bytes(bytes(40), 1)
    cache = PrefixCache(2 * size)
    for n in (1, 2, 3):
        cache.keep(bytes(40), (_cut(n),))
    assert len(cache) == 2 and cache.num_bytes == 2 * size
    assert cache.longest([_cut(1).digest]) is None
    assert cache.longest([_cut(2).digest]) is not None
    cache.keep(bytes(40), (_cut(4),))  # 3 is now the least recent
    assert cache.longest([_cut(3).digest]) is None
    cache.keep(bytes(10 * size), (_cut(5),))  # larger than the cache: not kept
    assert cache.longest([_cut(5).digest]) is None and cache.num_bytes <= 2 * size


def test_a_cut_kept_again_names_the_latest_text() -> None:
    cache = PrefixCache(1 << 20)
    cache.keep(bytes(40), (_cut(2),))
    cache.keep(bytes(range(40)), (_cut(2), _cut(7)))
    hit = cache.longest([_cut(2).digest])
    assert hit is not None and hit.packed == bytes(range(8))


def test_at_once_only_what_needs_no_thread() -> None:
    local = _local("byte_level_bpe", fast=False)  # the fast path needs none up to 64 kB
    messages = [{"role": "user", "content": "hello"}]
    assert local.messages_now(messages) == asyncio.run(local.packed_messages(messages))
    assert local.prompt_now("hello") == asyncio.run(local.packed_prompt("hello"))
    local.inline_max_chars = 0
    assert local.messages_now(messages + messages) is None
    assert local.prompt_now("hello again") is None


def test_a_tokenizer_that_fails_on_the_sample_is_not_cut() -> None:
    """A model whose encode raises (WordPiece without its unknown token) still loads: no
    anchors; its failures are reported where texts are encoded."""
    tok = tokenizers.Tokenizer(models.WordPiece(vocab={"a": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    local = LocalTokenizer(tok, prefix_cache_bytes=1 << 20)
    assert not local.anchors
    assert asyncio.run(local.encode_prompt("a a")) == [0, 0]


@pytest.mark.parametrize("reuse", [True, False])
def test_a_heads_rest_is_encoded_from_the_heads_end(reuse: bool) -> None:
    """A head's rest encodes only the text past the head (one head in CHECK_EVERY, the
    first, is encoded whole and compared), and equals the whole encode."""
    local = _local("byte_level_bpe", prefix_cache_bytes=(1 << 20) if reuse else 0)
    encoded = _counted(local)

    async def run() -> None:
        for n in range(3):
            prompt = f"Session {n}: " + " ".join(WORDS[n:] * 30)
            head = await local.prompt_head(prompt, 256)
            assert isinstance(head, Head)
            encoded.clear()
            whole = encode_whole(local.tokenizer, prompt, add_special_tokens=True)
            assert unpack_ids(await head.rest()) == whole
            rest = len(prompt) - len(local.tokenizer.decode(unpack_ids(head.packed)))
            assert sum(encoded) == (len(prompt) if n == 0 else rest), (n, encoded)

    asyncio.run(run())
    assert (local.num_heads, local.num_head_mismatches) == (3, 0)
