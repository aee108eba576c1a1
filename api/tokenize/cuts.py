"""Where a text may be cut without changing its ids: before an added token that sees no
further than its edge (no lstrip, single_word or normalized), as HF tokenizers split there
first; a tokenizer that truncates or pads gets no cuts."""

from __future__ import annotations

import re
from dataclasses import dataclass

import tokenizers


@dataclass(frozen=True, slots=True)
class Cut:
    """A cut: the text's character ``position`` where added token ``token_id`` starts."""

    position: int
    token_id: int


class Cuts:
    """The cuts of texts for one tokenizer (None from :meth:`of`: it has none)."""

    def __init__(self, content_to_id: dict[str, int]) -> None:
        self._content_to_id = content_to_id
        # Longest first: the alternation then prefers the longest, as the tokenizer's matcher.
        ordered = sorted(content_to_id, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(c) for c in ordered))

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
        """Every cut of ``text`` after its start, in order."""
        ids = self._content_to_id
        return [
            Cut(m.start(), ids[m.group()]) for m in self._pattern.finditer(text) if m.start() > 0
        ]
