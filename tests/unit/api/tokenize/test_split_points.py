"""kvindex.api.tokenize.split_points: the rules' search is their definition within its bounds,
and a tokenizer holds only the rules its ids allow."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.api.tokenize import split_points
from kvindex.api.tokenize.local import encode_whole, split_rules
from kvindex.api.tokenize.split_points import (
    CJK_PUNCTUATION,
    NONE,
    PUNCTUATION,
    WORDS,
    SplitRules,
    rules_holding,
    split_point,
)
from tests.support.tokenizer_kinds import KINDS

BOTH = SplitRules(punctuation=True)
_RULES = {"words": WORDS, "punctuation": PUNCTUATION, "both": BOTH, "none": NONE}


def _first_split(text: str, start: int, rules: SplitRules) -> int | None:
    """split_point's definition, walked a character at a time."""
    for at in range(max(start, 1), len(text)):
        if not text[at - 1].isalpha():
            continue
        if rules.words and text[at] == " " and text[at + 1 : at + 2].isalpha():
            return at
        if rules.punctuation and text[at] in CJK_PUNCTUATION:
            return at
    return None


@pytest.mark.parametrize("name", sorted(_RULES))
@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab ²1_é漢\u0301 \uff0c。「", max_size=60), start=st.integers(0, 70))
def test_split_point_is_its_definition(name: str, text: str, start: int) -> None:
    """Within its bounds (fewer candidates than it checks, a text shorter than it scans)
    the regex's search finds what the walk does."""
    rules = _RULES[name]
    assert split_point(text, start, rules) == _first_split(text, start, rules)


@pytest.mark.parametrize("name", sorted(_RULES))
@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab Z1_.", max_size=60), start=st.integers(0, 70))
def test_an_ascii_text_is_searched_as_its_definition(name: str, text: str, start: int) -> None:
    """An ASCII text is searched for spaces alone (no CJK punctuation can be in it)."""
    rules = _RULES[name]
    assert split_point(text, start, rules) == _first_split(text, start, rules)


def test_split_point_is_bounded_on_hostile_text() -> None:
    """A body of spaces, or of spaces between word characters that are not letters, gets no
    split past the bounds (so no walk of megabytes on the loop): such a text is encoded
    whole."""
    far = " " * split_points.MAX_SPLIT_SCAN + "ab cd"
    assert _first_split(far, 0, WORDS) is not None and split_point(far, 0) is None
    for letters in ("a" * split_points.MAX_SPLIT_SCAN, "漢" * split_points.MAX_SPLIT_SCAN):
        assert split_point(letters + " b", 0, BOTH) is None  # past the scan
        assert split_point(letters[:-2] + " b", 0, BOTH) == len(letters) - 2
    crowded = "² " * (split_points.MAX_SPLIT_CANDIDATES + 1) + "²ab cd"
    assert _first_split(crowded, 0, WORDS) is not None and split_point(crowded, 0) is None
    assert split_point("² " * 10 + "²ab cd", 0) == len("² " * 10 + "²ab")
    crowded_cjk = "²，" * (split_points.MAX_SPLIT_CANDIDATES + 1) + "好，"  # noqa: RUF001
    assert split_point(crowded_cjk, 0, PUNCTUATION) is None


def test_chinese_prose_is_cut_before_its_punctuation() -> None:
    text = "今天天气很好，我们去公园。"  # noqa: RUF001
    assert split_point(text, 0, PUNCTUATION) == text.index("，")  # noqa: RUF001
    assert split_point(text, 0, WORDS) is None


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("byte_level_bpe", BOTH),
        ("word_level", BOTH),
        ("metaspace_bpe", WORDS),  # "▁" is put before a text's start: not before punctuation
        ("prepend_bpe", NONE),  # the same before every text, even at a space
    ],
)
def test_a_tokenizer_holds_the_rules_its_ids_allow(name: str, expected: SplitRules) -> None:
    tok = KINDS[name]()[0]
    assert split_rules(tok) == expected


def test_a_rule_that_could_cut_an_added_token_is_not_held() -> None:
    tok = KINDS["byte_level_bpe"]()[0]

    def encode(text: str) -> list[int]:
        return encode_whole(tok, text, add_special_tokens=False)

    assert rules_holding(encode, [], ["<|a b|>"]) == PUNCTUATION
    assert rules_holding(encode, [], ["<｜end▁of｜>", "好。"]) == WORDS  # noqa: RUF001
