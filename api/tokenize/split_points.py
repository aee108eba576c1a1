"""Split points: where a text may be cut into two whose ids, encoded apart, are the whole
text's (a head, an anchor). Two rules, each held by a tokenizer whose ids on samples allow
it: a space between two letters, and a letter before Chinese or Japanese punctuation."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_SPLIT_CANDIDATES = 64  # places a split point's search checks
MAX_SPLIT_SCAN = 65536  # characters past its start it looks through
# The full-width punctuation Chinese and Japanese prose ends its clauses with: cut before.
CJK_PUNCTUATION = "、。〈〉《》「」『』【】！（），：；？"  # noqa: RUF001 (full-width, meant)
CJK_SAMPLE = (  # what the punctuation rule must hold on, besides the English sample
    "我们今天去公园散步，天气很好。明天呢？「東京タワー」は高い、とても！《书名》【注】"  # noqa: RUF001
    "한국어도（괄호）있어요：네；mixed，English。"  # noqa: RUF001
)

_LETTER = r"[^\W\d_]"  # the word characters that are not digits: a superset of the letters


@dataclass(frozen=True, slots=True)
class SplitRules:
    """Which rules a tokenizer's texts may be cut by (false: none)."""

    words: bool = True  # at a space between two letters (the space goes with the second part)
    punctuation: bool = False  # after a letter that CJK_PUNCTUATION follows
    pattern: re.Pattern[str] | None = field(init=False, repr=False, compare=False)
    ascii_pattern: re.Pattern[str] | None = field(init=False, repr=False, compare=False)
    """For an ASCII text (``str.isascii`` is a flag): no CJK punctuation to look for."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", _pattern(self.words, self.punctuation))
        object.__setattr__(self, "ascii_pattern", _pattern(self.words, False))

    def __bool__(self) -> bool:
        return self.words or self.punctuation


def _pattern(words: bool, punctuation: bool) -> re.Pattern[str] | None:
    # Each match is a candidate cut: a space before a word character, or the punctuation.
    # A space leads so that the regex scans for it alone (a letter first made it try every
    # letter of a text with no space; see the performance page).
    space, marks = f" (?={_LETTER})", f"[{CJK_PUNCTUATION}]"
    if words and punctuation:
        return re.compile(f"{space}|{marks}")
    if words:
        return re.compile(space)
    return re.compile(marks) if punctuation else None


WORDS = SplitRules()
PUNCTUATION = SplitRules(words=False, punctuation=True)
NONE = SplitRules(words=False)


def split_point(text: str, start: int, rules: SplitRules = WORDS) -> int | None:
    """The first index at or after ``start`` where ``rules`` cut ``text`` (None: none found)."""
    # The regex finds each candidate in C, within MAX_SPLIT_SCAN characters, at most
    # MAX_SPLIT_CANDIDATES of them: a text of spaces is neither walked a character at a time
    # nor scanned to its end.
    pattern = rules.ascii_pattern if text.isascii() else rules.pattern
    if pattern is None:
        return None
    search, at, last = pattern.search, max(start, 1), len(text) - 1
    end = at + MAX_SPLIT_SCAN
    for _ in range(MAX_SPLIT_CANDIDATES):
        found = search(text, at, end)
        if found is None:
            return None
        cut = found.start()
        if text[cut - 1].isalpha() and (
            text[cut] != " " or (cut < last and text[cut + 1].isalpha())
        ):
            return cut
        at = cut + 1
    return None


def splits_hold(
    encode: Callable[[str], list[int] | None], text: str, expected: list[int], rules: SplitRules
) -> bool:
    # Whether the text cut at each of its split points by the rules encodes as expected.
    at = split_point(text, 0, rules)
    while at is not None:
        if (encode(text[:at]) or []) + (encode(text[at:]) or []) != expected:
            return False
        at = split_point(text, at + 1, rules)
    return True


def rules_holding(
    encode: Callable[[str], list[int] | None], samples: list[str], added: list[str]
) -> SplitRules:
    """The rules whose cuts keep ``encode``'s ids on the samples, none that may cut an added
    token's content."""
    texts = [*samples, CJK_SAMPLE]
    expected = [encode(text) or [] for text in texts]

    def holds(rules: SplitRules) -> bool:
        return all(splits_hold(encode, t, e, rules) for t, e in zip(texts, expected, strict=True))

    words = not any(" " in content for content in added) and holds(WORDS)
    cuts_added = any(mark in content for content in added for mark in CJK_PUNCTUATION)
    return SplitRules(words, not cuts_added and holds(PUNCTUATION))
