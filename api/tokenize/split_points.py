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

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", _pattern(self.words, self.punctuation))

    def __bool__(self) -> bool:
        return self.words or self.punctuation


def _pattern(words: bool, punctuation: bool) -> re.Pattern[str] | None:
    # A word character before a space, before the punctuation, or either (the fastest of
    # the forms tried): each match's next character is where the text would be cut.
    if words and punctuation:
        return re.compile(f"{_LETTER}[ {CJK_PUNCTUATION}]")
    if words:
        return re.compile(f"{_LETTER}(?= {_LETTER})")
    return re.compile(f"{_LETTER}(?=[{CJK_PUNCTUATION}])") if punctuation else None


WORDS = SplitRules()
PUNCTUATION = SplitRules(words=False, punctuation=True)
NONE = SplitRules(words=False)


def split_point(text: str, start: int, rules: SplitRules = WORDS) -> int | None:
    """The first index at or after ``start`` where ``rules`` cut ``text`` (None: none found)."""
    # The regex finds each candidate (a word character before a space, and a word character
    # past it, or before the punctuation) in C, within MAX_SPLIT_SCAN characters, at most
    # MAX_SPLIT_CANDIDATES of them: a text of spaces is neither walked a character at a time
    # nor scanned to its end.
    pattern = rules.pattern
    if pattern is None:
        return None
    search, at, last = pattern.search, max(start, 1) - 1, len(text) - 1
    end = at + MAX_SPLIT_SCAN
    for _ in range(MAX_SPLIT_CANDIDATES):
        found = search(text, at, end)
        if found is None:
            return None
        cut = found.start() + 1
        if text[cut - 1].isalpha() and (
            text[cut] != " " or (cut < last and text[cut + 1].isalpha())
        ):
            return cut
        at = cut
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
