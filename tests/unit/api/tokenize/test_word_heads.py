"""kvindex.api.tokenize.word_heads: heads cut where the tokenizer's own words start."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, models, pre_tokenizers

from kvindex.api.tokenize import local as local_module
from kvindex.api.tokenize.fast_bpe import SELF_TEST
from kvindex.api.tokenize.local import LocalTokenizer, special_wrap
from kvindex.api.tokenize.protocol import Head, pack_ids
from kvindex.api.tokenize.word_heads import WINDOW_SLACK, WordHeads
from tests.support.tokenizer_kinds import KINDS, MASK

HEX = "0123456789abcdef"


def hex_pairs() -> tokenizers.Tokenizer:
    """A word model over pairs of hex digits, cut every two characters (no space anywhere):
    the shape of the router replay's tokenizer, small."""
    vocab = {a + b: 1 + 16 * i + j for i, a in enumerate(HEX) for j, b in enumerate(HEX)}
    tok = tokenizers.Tokenizer(models.WordLevel({**vocab, "[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(".{1,2}"), behavior="isolated")
    tok.add_special_tokens(["<|sep|>"])
    return tok


def hex_text(rng: random.Random, num_chars: int) -> str:
    return "".join(rng.choice(HEX) for _ in range(num_chars))


def json_text(rng: random.Random, num_items: int) -> str:
    items = ",".join(
        f'{{"k{i}":"v{rng.randrange(999)}","n":[{i},{i * 7}]}}' for i in range(num_items)
    )
    return f'{{"id":{rng.randrange(10**6)},"items":[{items}],"ok":true}}'


HOLDING = [*(name for name in KINDS if name != "prepend_bpe"), "hex_pairs"]


def _tokenizer(name: str) -> tokenizers.Tokenizer:
    return hex_pairs() if name == "hex_pairs" else KINDS[name]()[0]


def _ids(tok: tokenizers.Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("name", HOLDING)
def test_a_head_and_its_rest_encode_as_the_whole(name: str) -> None:
    """For texts with no space between two letters and texts with spaces, at every least
    position, a head's ids then the rest's from its cut are the whole text's."""
    tok = _tokenizer(name)
    heads = WordHeads.of(tok, [SELF_TEST])
    assert heads is not None
    rng = random.Random(3)
    texts = [hex_text(rng, 900), json_text(rng, 30), SELF_TEST * 4, "漢字かなカナ" * 80]
    found = 0
    for text in texts:
        whole = _ids(tok, text)
        for min_chars in range(1, len(text) - WINDOW_SLACK, 37):
            got = heads.head(text, min_chars)
            if got is None:
                continue
            cut, ids = got
            assert min_chars <= cut < min_chars + WINDOW_SLACK
            assert ids + _ids(tok, text[cut:]) == whole
            found += 1
    assert found > 20


@settings(max_examples=60, deadline=None)
@given(
    pieces=st.lists(
        st.sampled_from(["ab", "3f", "{", '"k":', ",", " ", "  ", "\n", "漢", "\uff0c", "<|sep|>"]),
        min_size=40,
        max_size=200,
    ),
    min_chars=st.integers(1, 120),
)
def test_a_word_head_of_any_text_is_the_whole_ids_start(pieces: list[str], min_chars: int) -> None:
    tok = hex_pairs()
    heads = WordHeads.of(tok, [SELF_TEST])
    assert heads is not None
    text = "".join(pieces)
    got = heads.head(text, min_chars)
    if got is not None:
        cut, ids = got
        assert ids + _ids(tok, text[cut:]) == _ids(tok, text)


def test_only_tokenizers_whose_ids_allow_it_get_word_heads() -> None:
    """Llama 2's shape (no pre-tokenizer: a text is one word) gets none, nor a tokenizer that
    puts a space before every text, nor one that truncates."""
    assert WordHeads.of(KINDS["prepend_bpe"]()[0], [SELF_TEST]) is None
    prefixed = tokenizers.Tokenizer(models.BPE())
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    prefixed.train_from_iterator(
        [SELF_TEST] * 3,
        tokenizers.trainers.BpeTrainer(
            vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    assert WordHeads.of(prefixed, [SELF_TEST]) is None
    truncating = hex_pairs()
    truncating.enable_truncation(64)
    assert WordHeads.of(truncating, [SELF_TEST]) is None


@pytest.mark.parametrize("added", ["<|sep|>", MASK])
def test_no_cut_inside_or_beside_an_added_token(added: str) -> None:
    """A window that ends inside an added token shows its content as plain words: the cut
    is never inside it, nor at the whitespace a token that strips its side would take."""
    tok = KINDS["byte_level_bpe"]()[0] if added == MASK else hex_pairs()
    heads = WordHeads.of(tok, [SELF_TEST])
    assert heads is not None
    rng = random.Random(5)
    base = hex_text(rng, 600)
    for at in range(200, 300, 3):
        text = f"{base[:at]}  {added}{base[at:]}"
        whole = _ids(tok, text)
        for min_chars in range(at - WINDOW_SLACK - 10, at + 10):
            got = heads.head(text, min_chars)
            if got is None:
                continue
            cut, ids = got
            assert not at <= cut <= at + 2 + len(added)
            assert ids + _ids(tok, text[cut:]) == whole


def test_no_head_in_one_long_word_nor_when_the_window_is_the_text() -> None:
    heads = WordHeads.of(KINDS["byte_level_bpe"]()[0], [SELF_TEST])
    assert heads is not None
    assert heads.head("a" * 2000, 256) is None
    assert heads.head("ab " * 100, 256) is None


def test_a_long_text_no_split_point_cuts_is_decided_on_a_word_head() -> None:
    """A prompt of hex (no space, no punctuation) gets a Head; its rest is its whole ids."""
    tok = hex_pairs()
    local = LocalTokenizer(tok)
    assert local.features()["word_heads"] and not local.features()["split_words"]
    prompt = hex_text(random.Random(9), 2000)
    head = asyncio.run(local.prompt_head(prompt, 256))
    expected = pack_ids(tok.encode(prompt).ids)
    assert isinstance(head, Head) and expected.startswith(head.packed)
    assert len(head.packed) // 4 >= 128 and 0.9 < head.num_tokens / (len(expected) // 4) < 1.1
    assert asyncio.run(head.rest()) == expected
    assert (local.num_heads, local.num_head_mismatches) == (1, 0)
    second = hex_text(random.Random(10), 2000)
    head = asyncio.run(local.prompt_head(second, 256))  # encoded from the head's end
    assert isinstance(head, Head)
    assert asyncio.run(head.rest()) == pack_ids(tok.encode(second).ids)


@pytest.mark.parametrize("released", [False, True])
@pytest.mark.parametrize("name", HOLDING)
def test_anchors_and_the_tail_encode_as_the_whole(name: str, released: bool) -> None:
    """Heads taken one window after another from a word's start, then the tail from the
    last cut: their ids are the whole text's."""
    tok = _tokenizer(name)
    heads = WordHeads.of(tok, [SELF_TEST])
    assert heads is not None
    rng = random.Random(11)
    texts = [hex_text(rng, 3000), json_text(rng, 80), SELF_TEST * 6, "漢字かな交じり文" * 200]
    for text in texts:
        whole = _ids(tok, text)
        for step in (100, 257):
            ends = list(range(step + WINDOW_SLACK, len(text), step))
            found = heads.anchors(text, 0, ends, released=released)
            cuts = [cut for _, cut, _ in found]
            assert cuts == sorted(cuts) and all(c >= ends[i] - WINDOW_SLACK for i, c, _ in found)
            at = cuts[-1] if cuts else 0
            ids = [i for _, _, piece in found for i in piece] + _ids(tok, text[at:])
            assert ids == whole


def _word_local(prefix_cache_bytes: int = 1 << 22) -> tuple[tokenizers.Tokenizer, LocalTokenizer]:
    tok = hex_pairs()
    return tok, LocalTokenizer(tok, prefix_cache_bytes=prefix_cache_bytes, fast=False)


def test_word_anchored_prompts_reuse_their_kept_starts() -> None:
    """A prompt no split point cuts is kept at word anchors: a later prompt starting as it
    does is encoded from the last anchor both share, and every prompt's ids are whole."""
    tok, local = _word_local()
    assert local.features()["anchors"] and local.word_anchors
    rng = random.Random(12)
    base = hex_text(rng, 6000)
    prompts = [base, base[:4500] + hex_text(rng, 900), base[:1500] + hex_text(rng, 3000)]
    prompts += [hex_text(rng, 2500), prompts[1][:3000] + "<|sep|>" + hex_text(rng, 500)]
    starts: list[int] = []
    pieces = local._word_pieces

    def recorded(text: str, start: int, *rest: Any) -> Any:
        starts.append(start)
        return pieces(text, start, *rest)

    local._word_pieces = recorded  # type: ignore[method-assign,assignment]
    for number, prompt in enumerate(prompts):
        packed = asyncio.run(local.packed_prompt(prompt))
        assert packed == pack_ids(tok.encode(prompt).ids), number
    # Encoded from: the start; the last anchor before 4,500 (window end 4,160); before 1,500.
    assert starts[0] == 0 and 4096 <= starts[1] < 4160 and 1024 <= starts[2] < 1088
    assert local.num_reused == 2  # the second and third (the fifth has a cut: its own plan)
    assert local.num_head_mismatches == 0


def test_a_held_word_head_is_encoded_from_its_kept_start() -> None:
    """A long prompt whose start is kept is answered whole (no head), from the kept ids."""
    tok, local = _word_local()
    rng = random.Random(13)
    first = hex_text(rng, 5000)
    head = asyncio.run(local.prompt_head(first, 256))
    assert isinstance(head, Head)
    assert asyncio.run(head.rest()) == pack_ids(tok.encode(first).ids)
    second = first[:4000] + hex_text(rng, 1000)
    got = asyncio.run(local.prompt_head(second, 256))
    assert got == pack_ids(tok.encode(second).ids)
    assert local.num_reused == 1


def test_word_anchors_that_do_not_hold_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first word-anchored prompt is checked whole: anchors that differ from it are
    dropped (counted), and the whole ids answered."""
    tok, local = _word_local()
    real = WordHeads.anchors

    def shifted(self: WordHeads, *args: Any, **kwargs: Any) -> list[tuple[int, int, list[int]]]:
        return [(i, cut, ids[:-1]) for i, cut, ids in real(self, *args, **kwargs)]

    monkeypatch.setattr(WordHeads, "anchors", shifted)
    prompt = hex_text(random.Random(14), 3000)
    assert asyncio.run(local.packed_prompt(prompt)) == pack_ids(tok.encode(prompt).ids)
    assert not local.word_anchors and local.num_head_mismatches == 1
    assert asyncio.run(local.packed_prompt(prompt)) == pack_ids(tok.encode(prompt).ids)


def test_a_prompt_past_the_word_anchors_bound_is_encoded_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Word anchors cost twice a whole encode: a prompt longer than their bound is not cut."""
    monkeypatch.setattr(local_module, "WORD_ANCHORS_MAX_CHARS", 3000)
    tok, local = _word_local()
    rng = random.Random(15)
    first = hex_text(rng, 3001)
    for prompt in (first, first[:2500] + hex_text(rng, 501)):
        assert asyncio.run(local.packed_prompt(prompt)) == pack_ids(tok.encode(prompt).ids)
    assert local.num_reused == 0
    assert asyncio.run(local.packed_prompt(first[:2999])) == pack_ids(tok.encode(first[:2999]).ids)
    assert asyncio.run(local.packed_prompt(first[:2990] + "ab")) == pack_ids(
        tok.encode(first[:2990] + "ab").ids
    )
    assert local.num_reused == 1


def test_a_long_word_anchored_prompt_is_not_encoded_at_once() -> None:
    """Past the inline bound a word-anchored prompt needs the worker thread: at once gives
    None (the caller awaits instead), counting nothing; within it, the whole ids."""
    tok, local = _word_local()
    rng = random.Random(16)
    long, short = hex_text(rng, 3000), hex_text(rng, 1500)
    assert local.prompt_now(long) is None and local.num_anchored == 0
    assert asyncio.run(local.packed_prompt(long)) == pack_ids(tok.encode(long).ids)
    assert local.prompt_now(short) == pack_ids(tok.encode(short).ids)
    assert local.num_anchored == 2


@pytest.mark.parametrize("name", HOLDING)
def test_every_holding_kind_reuses_word_anchors_from_a_head_as_the_whole(name: str) -> None:
    """For each tokenizer kind word heads hold for: a new prompt decided on its head, its
    rest (anchored from the head's cut), then prompts sharing its start, all encode as
    their whole ids."""
    tok = _tokenizer(name)
    local = LocalTokenizer(tok, prefix_cache_bytes=1 << 22, fast=False)
    rng = random.Random(17)
    document = json_text(rng, 120) if name != "hex_pairs" else hex_text(rng, 4000)
    head = asyncio.run(local.prompt_head(document, 256))
    whole = asyncio.run(head.rest()) if isinstance(head, Head) else head
    assert whole == pack_ids(tok.encode(document).ids)
    for cut in (len(document) - 10, len(document) // 2, 1500):
        prompt = document[:cut] + document[:300]
        assert asyncio.run(local.packed_prompt(prompt)) == pack_ids(tok.encode(prompt).ids)
    assert local.num_head_mismatches == 0
    # Reused where the document has word anchors (Metaspace's words end at spaces alone: a
    # JSON text is one word) and its prompts are reused at all (an even post-processor).
    ends = list(range(1024 + WINDOW_SLACK, len(document), 1024))
    assert local.word_heads is not None
    anchored = bool(local.word_heads.anchors(document, 0, ends))
    reusing = anchored and special_wrap(tok) is not None
    assert local.num_reused >= 2 if reusing else local.num_reused == 0


def test_a_word_plan_made_before_word_anchors_were_dropped_encodes_as_the_whole() -> None:
    """A plan made with a kept start, then word anchors dropped (another prompt's check
    failed) before it is encoded: the text is cut as any other, its ids whole."""
    tok, local = _word_local()
    rng = random.Random(18)
    document = hex_text(rng, 5000)
    asyncio.run(local.packed_prompt(document))
    later = document[:4000] + hex_text(rng, 500)
    plan = local._plan(later, anchored=True)
    assert plan is not None and plan.ends is not None and plan.hit is not None
    local.word_anchors = False
    got = asyncio.run(local._packed(later, now=False, plan=plan))
    assert got == pack_ids(tok.encode(later).ids)
