"""Where a text may be cut without changing its ids: before an added token that sees no
further than its edge (no lstrip, single_word or normalized), as HF tokenizers split there
first; a tokenizer that truncates or pads gets no cuts."""

from __future__ import annotations

import re
from dataclasses import dataclass

import tokenizers

MAX_CANDIDATES = 256
"""Most starting characters :meth:`Cuts.find` tries one by one; more: the regex scans."""


@dataclass(frozen=True, slots=True)
class Cut:
    """A cut: the text's character ``position`` where added token ``token_id`` starts (None:
    an anchor, a split point of the fast path's, with no token of its own)."""

    position: int
    token_id: int | None


class Cuts:
    """The cuts of texts for one tokenizer (None from :meth:`of`: it has none)."""

    def __init__(self, content_to_id: dict[str, int]) -> None:
        self._content_to_id = content_to_id
        # Longest first: the alternation then prefers the longest, as the tokenizer's matcher.
        ordered = sorted(content_to_id, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(c) for c in ordered))
        self._first_chars = sorted({c[0] for c in content_to_id})

    @classmethod
    def of(cls, tokenizer: tokenizers.Tokenizer) -> Cuts | None:
        if tokenizer.truncation is not None or tokenizer.padding is not None:
            return None
        content_to_id = {
            added.content: token_id
            for token_id, added in tokenizer.get_added_tokens_decoder().items()
            if added.content and not (added.lstrip or added.single_word or added.normalized)
        }
        return cls(content_to_id) if content_to_id else None

    def find(self, text: str) -> list[Cut]:
        """Reference: :meth:`find_by_regex`; tests/unit/api/tokenize/test_prefix_reuse.py::test_find_equals_find_by_regex

        Every cut of ``text`` after its start, in order: the regex tried only where a
        token's first character is (found by ``str.find``, a memchr), unless those are
        many (:data:`MAX_CANDIDATES`), where the regex's own scan is cheaper."""  # noqa: E501
        candidates = _positions(text, self._first_chars, MAX_CANDIDATES)
        if candidates is None:
            return self.find_by_regex(text)
        match, ids = self._pattern.match, self._content_to_id
        found: list[Cut] = []
        end = 0  # as finditer: no match starts inside the previous one
        for start in sorted(candidates):
            if start < end:
                continue
            matched = match(text, start)
            if matched is not None:
                end = matched.end()
                if start > 0:
                    found.append(Cut(start, ids[matched.group()]))
        return found

    def find_by_regex(self, text: str) -> list[Cut]:
        """Every cut of ``text`` after its start, in order, by one scan of the regex."""
        ids = self._content_to_id
        return [
            Cut(m.start(), ids[m.group()]) for m in self._pattern.finditer(text) if m.start() > 0
        ]


def _positions(text: str, chars: list[str], limit: int) -> list[int] | None:
    """Every index of ``text`` holding one of ``chars``; None when more than ``limit``."""
    positions: list[int] = []
    for char in chars:
        at = text.find(char)
        while at >= 0:
            if len(positions) == limit:
                return None
            positions.append(at)
            at = text.find(char, at + 1)
    return positions
