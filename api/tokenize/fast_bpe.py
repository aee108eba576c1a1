"""Reference: kvindex.api.tokenize.local.encode_whole; tests/unit/api/tokenize/test_fast_bpe.py::test_fast_ids_equal_the_tokenizers_own

A byte-level BPE ``tokenizer.json``'s ids by tiktoken's encoder, for the shapes it reproduces
id for id (see :func:`_shape`); texts it cannot vouch for are left to the tokenizer.
"""  # noqa: E501

from __future__ import annotations

import json
import logging
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import tiktoken
import tokenizers

from kvindex.api.tokenize.split_points import NONE, rules_holding, split_point

logger = logging.getLogger(__name__)

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
"""The regex of ``ByteLevel(use_regex=True)``, as ``tokenizers`` writes it."""

_SURROGATE = re.compile("[\ud800-\udfff]")
SELF_TEST = (
    "Hello world! It's 2026-12-06T18:30:00Z; we'll see.  Tabs\tand\nnew\r\nlines   end \n\n"
    'def f(x):\n    return x ** 2  # a comment\n{"k": [1, 22, 333, 4444]}\n'
    "Ünïcödé, 漢字, emoji 🙂, Ελληνικά, русский, العربية. I'M DONE'S 's 'LL\u00a0nbsp"
)
"""Text the fast path must encode as the tokenizer does before it is used."""


@dataclass(frozen=True, slots=True)
class _Shape:
    pattern: str
    nfc: bool
    ranks: dict[bytes, int]


class FastBpe:
    """Encodes texts as its tokenizer does (no special tokens added), or answers None."""

    def __init__(
        self, encoding: tiktoken.Encoding, added: Mapping[str, int], stripping: set[str], nfc: bool
    ) -> None:
        self._encode = encoding.encode_ordinary
        self._added = added
        self._stripping = stripping
        ordered = sorted(added, key=len, reverse=True)  # the longest first, as the matcher
        self._added_pattern = re.compile("|".join(map(re.escape, ordered))) if added else None
        self._nfc = nfc
        self.splits = NONE
        """Where texts may be cut (:meth:`of` finds the rules that hold)."""

    @classmethod
    def of(cls, tokenizer: tokenizers.Tokenizer) -> FastBpe | None:
        """The fast path, or None (logged): a shape not reproduced, or ids off on the sample."""
        config = json.loads(tokenizer.to_str())
        shape = _shape(config)
        if isinstance(shape, str):
            logger.info("the tokenizer is encoded by tokenizers alone: %s", shape)
            return None
        added: dict[str, int] = {}
        stripping: set[str] = set()
        for token_id, token in tokenizer.get_added_tokens_decoder().items():
            added[token.content] = token_id
            if token.lstrip or token.rstrip or token.single_word or token.normalized:
                stripping.add(token.content)
        encoding = tiktoken.Encoding(
            "kvindex-bpe", pat_str=shape.pattern, mergeable_ranks=shape.ranks, special_tokens={}
        )
        fast = cls(encoding, added, stripping, shape.nfc)
        expected = tokenizer.encode(SELF_TEST, add_special_tokens=False).ids
        if fast.encode(SELF_TEST) != expected:
            logger.warning("the tokenizer's fast path differs from it on a sample: not used")
            return None
        fast.splits = rules_holding(fast.encode, [SELF_TEST], list(added))
        if not fast.splits.words:
            logger.info("the tokenizer's ids change when a text is cut between words: not cut")
        return fast

    def split_point(self, text: str, start: int) -> int | None:
        """Reference: encode(text); tests/unit/api/tokenize/test_fast_bpe.py::test_split_encodes_equal_the_whole

        :func:`.split_point` by the rules that hold, where every reproduced regex ends a
        piece (None: also when no rule holds)."""  # noqa: E501
        return split_point(text, start, self.splits)

    def encode(self, text: str) -> list[int] | None:
        """The tokenizer's ids of ``text`` (none added); None: a stripping added token, an
        unpaired surrogate or text NFC would change."""
        if not text.isascii() and (
            _SURROGATE.search(text) or (self._nfc and not unicodedata.is_normalized("NFC", text))
        ):
            return None
        pattern = self._added_pattern
        if pattern is None:
            return self._encode(text)
        ids: list[int] = []
        start = 0
        for match in pattern.finditer(text):
            content = match.group()
            if content in self._stripping:
                return None
            if match.start() > start:
                ids += self._encode(text[start : match.start()])
            ids.append(self._added[content])
            start = match.end()
        if start < len(text):
            ids += self._encode(text[start:])
        return ids


def _shape(config: dict[str, Any]) -> _Shape | str:
    """Pattern, NFC and ranks: a BPE holding every byte, ids rising with its merges, a GPT-2
    or ``Split`` regex before a byte-level pre-tokenizer, no normalizer but NFC; else why not."""
    if config.get("truncation") is not None or config.get("padding") is not None:
        return "it truncates or pads"
    normalizer = config.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        return f"its normalizer is {normalizer.get('type')}"
    pattern = _pattern(config.get("pre_tokenizer"))
    if pattern is None:
        return "its pre-tokenizer is not byte-level with a regex"
    ranks = _ranks(config.get("model") or {})
    if isinstance(ranks, str):
        return ranks
    return _Shape(pattern, normalizer is not None, ranks)


def _pattern(pre: dict[str, Any] | None) -> str | None:
    """The regex that splits a text before byte-level BPE, for the shapes reproduced."""
    if pre is None:
        return None
    if pre.get("type") == "ByteLevel":
        plain = not pre.get("add_prefix_space") and pre.get("use_regex", True)
        return GPT2_PATTERN if plain else None
    steps = pre.get("pretokenizers") or []
    if pre.get("type") != "Sequence" or len(steps) != 2:
        return None
    split, level = steps
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or "Regex" not in (split.get("pattern") or {})
        or level.get("type") != "ByteLevel"
        or level.get("add_prefix_space")
        or level.get("use_regex", True)
    ):
        return None
    return str(split["pattern"]["Regex"])


def _ranks(model: dict[str, Any]) -> dict[bytes, int] | str:
    """The vocabulary as tiktoken's ranks (a token's bytes → its id), or why it cannot be."""
    if model.get("type") != "BPE":
        return f"its model is {model.get('type')}"
    if model.get("dropout") or model.get("byte_fallback"):
        return "its BPE drops out or falls back to bytes"
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "its BPE marks subwords"
    vocab: dict[str, int] = model.get("vocab") or {}
    to_byte = _unicode_to_byte()
    ranks: dict[bytes, int] = {}
    for token, token_id in vocab.items():
        if not all(ch in to_byte for ch in token):
            return "its vocabulary is not byte-level"
        ranks[bytes(to_byte[ch] for ch in token)] = token_id
    if len(ranks) != len(vocab) or any(bytes([b]) not in ranks for b in range(256)):
        return "its vocabulary lacks a byte"
    last = -1
    for merge in model.get("merges") or []:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        merged = vocab.get(left + right, -1)
        if merged <= max(last, vocab.get(left, merged), vocab.get(right, merged)):
            return "its ids do not rise with its merges"
        last = merged
    return ranks


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    shifted = 0
    byte_values = list(printable)
    for b in range(256):
        if b not in printable:
            byte_values.append(b)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(byte_values, chars, strict=True)}
