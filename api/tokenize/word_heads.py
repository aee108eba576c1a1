"""Word heads: a head cut where the tokenizer's own pre-tokenizer starts a word, for texts no
split rule cuts (:mod:`.split_points`), held for a tokenizer when its ids on samples allow."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

import tokenizers

from kvindex.api.tokenize.split_points import CJK_SAMPLE

WINDOW_SLACK = 64  # characters past the cut's least position that a head's window reaches
MAX_WHITESPACE_RUN = 256  # a longer run of whitespace around a cut: no head there
SAMPLES = (  # texts with few or no spaces, besides the English and CJK samples
    "3f8a9b0c41d2e7f65a0b1c2d3e4f5a6b7c8d9e0f" * 3,
    '{"id":42,"items":[{"k":"v","n":[1,22,333]},{"k":"w"}],"ok":true,"s":"a\\"b"}' * 2,
    "aGVsbG8gd29ybGQhIGJhc2U2NCBibG9iczpwbHVzKy9zbGFzaD09" * 2,
)


Encode = Callable[[str], tokenizers.Encoding]


class WordHeads:
    # Word heads of one tokenizer's texts (None from `of`: its ids on the samples do not
    # allow them): a window of a text's start encoded, its last word (maybe cut) dropped.

    def __init__(self, tokenizer: tokenizers.Tokenizer, added: Iterable[str]) -> None:
        self.tokenizer = tokenizer
        contents = sorted({c for c in added if c}, key=len, reverse=True)
        self._added = re.compile("|".join(map(re.escape, contents))) if contents else None
        self._longest = len(contents[0]) if contents else 0

    @classmethod
    def of(cls, tokenizer: tokenizers.Tokenizer, samples: Iterable[str]) -> WordHeads | None:
        if tokenizer.truncation is not None or tokenizer.padding is not None:
            return None
        added = [token.content for token in tokenizer.get_added_tokens_decoder().values()]
        heads = cls(tokenizer, added)
        try:
            checked = [heads.checked_on(text) for text in (*samples, CJK_SAMPLE, *SAMPLES)]
        except Exception:  # the Rust binding raises a bare Exception: then no word heads
            return None
        # None: a head differed; no head at all: one word a text (no pre-tokenizer).
        return heads if None not in checked and any(checked) else None

    def head(self, text: str, min_chars: int) -> tuple[int, list[int]] | None:
        """Reference: encode(text); tests/unit/api/tokenize/test_word_heads.py::test_a_head_and_its_rest_encode_as_the_whole

        (cut, ids): where the last word of the window ``text[:min_chars + WINDOW_SLACK]``
        starts, at or after ``min_chars``, and the ids before it (no special tokens added);
        None: the window is the whole text, its last word starts earlier, or an added token
        is near the cut."""  # noqa: E501
        return self._head(text, min_chars + WINDOW_SLACK, min_chars)

    def anchors(
        self, text: str, start: int, ends: Sequence[int], *, released: bool = False
    ) -> list[tuple[int, int, list[int]]]:
        """Reference: encode(text); tests/unit/api/tokenize/test_word_heads.py::test_anchors_and_the_tail_encode_as_the_whole

        Heads taken one after another from ``start`` (a word's start): for each window end
        of ``ends`` past it, in order, (its index, the cut, the ids from the last cut to
        it), the cut at or after ``end - WINDOW_SLACK``; they stop at the first window
        without one. ``released``: encoded with the GIL released (a worker thread's)."""  # noqa: E501
        encode = self._released if released else self._encode
        found: list[tuple[int, int, list[int]]] = []
        at = start
        for index, end in enumerate(ends):
            least = end - WINDOW_SLACK
            if least <= at:
                continue
            got = self._head(text, end, least, start=at, encode=encode)
            if got is None:
                break
            at, ids = got
            found.append((index, at, ids))
        return found

    def _encode(self, text: str) -> tokenizers.Encoding:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _released(self, text: str) -> tokenizers.Encoding:
        # The batch call releases the GIL while it works; the single one does not.
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0]

    def _head(
        self,
        text: str,
        end: int,
        min_chars: int,
        *,
        start: int = 0,
        encode: Encode | None = None,
    ) -> tuple[int, list[int]] | None:
        # The window is text[start:end], ``start`` a word's start; the cut is text's index.
        if end >= len(text):
            return None
        encoding = (encode or self._encode)(text[start:end])
        num_ids = len(encoding.ids)
        last = encoding.token_to_word(num_ids - 1) if num_ids else None
        if last is None:
            return None
        cut = encoding.word_to_chars(last)
        first = encoding.word_to_tokens(last)
        if cut is None or first is None or start + cut[0] < min_chars:
            return None
        if self._near_added(text, start + cut[0]):
            return None
        return start + cut[0], encoding.ids[: first[0]]

    def _near_added(self, text: str, cut: int) -> bool:
        # Whether an added token's content spans the cut, or touches the whitespace around
        # it (which a token that strips its sides would take): no cut there.
        if self._added is None:
            return False
        low, high = cut, cut
        while low > 0 and text[low - 1].isspace() and cut - low < MAX_WHITESPACE_RUN:
            low -= 1
        while high < len(text) and text[high].isspace() and high - cut < MAX_WHITESPACE_RUN:
            high += 1
        if cut - low >= MAX_WHITESPACE_RUN or high - cut >= MAX_WHITESPACE_RUN:
            return True
        reach = self._longest
        found = self._added.finditer(text, max(0, low - reach), high + reach)
        return any(m.start() <= high and m.end() >= low and m.start() != m.end() for m in found)

    def checked_on(self, text: str) -> int | None:
        # How many heads of the text (windows ending all through it) were found, each with
        # the rest after its cut encoding as the whole does; None: one did not.
        whole = self.tokenizer.encode(text, add_special_tokens=False).ids
        found = 0
        for end in range(2, len(text), 3):
            got = self._head(text, end, 1)
            if got is None:
                continue
            cut, ids = got
            rest = self.tokenizer.encode(text[cut:], add_special_tokens=False).ids
            if ids + rest != whole:
                return None
            found += 1
        return found
