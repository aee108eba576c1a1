"""In-process tokenization: a ``tokenizer.json`` and the model's chat template, reusing the
ids of a text's start that an earlier text shared (:mod:`.prefix_cache`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Self, cast

import tokenizers

from kvindex.api.tokenize.chat_template import ChatTemplate, load_chat_template
from kvindex.api.tokenize.cuts import Cut, Cuts
from kvindex.api.tokenize.fast_bpe import SELF_TEST, FastBpe
from kvindex.api.tokenize.prefix_cache import (
    WORD_ANCHORS,
    KeptCut,
    PrefixCache,
    PrefixHit,
    cut_digests,
)
from kvindex.api.tokenize.protocol import (
    NO_OPTIONS,
    ChatOptions,
    Head,
    TokenizerError,
    pack_ids,
    unpack_ids,
)
from kvindex.api.tokenize.split_points import NONE, SplitRules, rules_holding, split_point
from kvindex.api.tokenize.word_heads import WINDOW_SLACK, WordHeads

logger = logging.getLogger(__name__)

INLINE_MAX_CHARS = 2048
"""Texts up to this long are encoded on the event loop; longer ones in a worker thread."""
FAST_INLINE_MAX_CHARS = 65536
"""The same bound when the fast path (:mod:`.fast_bpe`) encodes."""
CHECK_EVERY = 256
"""One text in this many that the fast path encodes is encoded by the tokenizer as well."""
DEFAULT_PREFIX_CACHE_BYTES = 32 * 1024 * 1024
ANCHOR_CHARS = 1024
"""A prompt is cut about this often, at split points (its anchors, :func:`.split_point`), so
that a prompt starting as a kept one is encoded from there: it may hold no added token."""
CHECK_MAX_CHARS = 8192  # the longest anchored prompt tokenizers (no fast path) check whole
WORD_ANCHORS_MAX_CHARS = 262144  # longer: encoded whole (windows cost more than one encode)


def encode_whole(tokenizer: tokenizers.Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """The ids of ``text`` encoded at once: what the prefix reuse must equal."""
    return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


class LocalTokenizer:
    """A :class:`~.protocol.PackedTokenizer` in process. With ``prefix_cache_bytes`` > 0 a text
    is encoded from the longest cut it shares with a text encoded before (the ids equal the
    whole text's); 0 encodes every text whole. Used by one event loop."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: ChatTemplate | None = None,
        *,
        inline_max_chars: int = INLINE_MAX_CHARS,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        fast: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.inline_max_chars = inline_max_chars
        self.num_reused = 0
        """Texts encoded from a kept prefix (the rest encoded whole)."""
        self.fast = FastBpe.of(tokenizer) if fast else None
        """The fast path (None: the tokenizer encodes every text); dropped at a mismatch."""
        self.num_fast = 0
        """Texts the fast path encoded."""
        self.num_fast_mismatches = 0
        """Checked texts whose fast ids differed from the tokenizer's (the first drops it)."""
        # The fast path has checked its split points already (FastBpe.of), with the same ids.
        rules = split_rules(tokenizer) if self.fast is None else self.fast.splits
        self.split_rules = rules  # where heads and anchors cut texts (.split_points)
        # Where heads cut a text no rule cuts: at a word's start the tokenizer shows.
        self.word_heads = WordHeads.of(tokenizer, [SELF_TEST])
        self.heads = bool(rules) or self.word_heads is not None
        """:meth:`messages_head` and :meth:`prompt_head` may answer with a Head."""
        self.num_heads = 0
        self.num_head_mismatches = 0
        self.anchor_chars = ANCHOR_CHARS
        # A prompt is cut at its anchors too; dropped at a mismatch.
        self.anchors = prefix_cache_bytes > 0 and bool(rules)
        self.num_anchored = 0  # prompts cut at anchors (one in CHECK_EVERY checked whole)
        # A prompt nothing else cuts is cut at word heads, one window after another.
        self.word_anchors = prefix_cache_bytes > 0 and self.word_heads is not None
        cuts = Cuts.of(tokenizer) if prefix_cache_bytes > 0 else None
        self._cuts = cuts
        anchoring = self.anchors or self.word_anchors
        reusing = prefix_cache_bytes > 0 and (cuts is not None or anchoring)
        self.prefixes = PrefixCache(prefix_cache_bytes) if reusing else None
        # A prompt's ids are reused when the post-processor adds the same ids around each.
        self._wrap = special_wrap(tokenizer)

    def tallies(self) -> dict[str, int]:
        # Texts encoded from a kept start, prompts cut at anchors, heads handed out, texts
        # the fast path encoded, and the checks that found ids differing.
        mismatches = self.num_fast_mismatches + self.num_head_mismatches
        return {
            "reused": self.num_reused,
            "anchored": self.num_anchored,
            "head": self.num_heads,
            "fast": self.num_fast,
            "mismatch": mismatches,
        }

    def features(self) -> dict[str, bool]:
        rules = self.split_rules
        return {
            "fast_path": self.fast is not None,
            "heads": self.heads,
            "anchors": self.anchors or self.word_anchors,
            "split_words": rules.words,
            "split_punctuation": rules.punctuation,
            "word_heads": self.heads and self.word_heads is not None,
        }

    @classmethod
    def from_files(
        cls,
        path: str | Path,
        chat_template_path: str | Path | None = None,
        *,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
    ) -> Self:
        path = Path(path)
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust binding raises a bare Exception
            raise TokenizerError(f"tokenizer file {path}: unreadable: {exc}") from exc
        template_path = None if chat_template_path is None else Path(chat_template_path)
        template = load_chat_template(path, template_path)
        return cls(tokenizer, template, prefix_cache_bytes=prefix_cache_bytes)

    async def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of ``prompt`` with the post-processor's special tokens (e.g. BOS)."""
        return unpack_ids(await self.packed_prompt(prompt))

    async def encode_messages(
        self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS
    ) -> list[int]:
        """Token ids of the rendered conversation; no special tokens added on top of it."""
        return unpack_ids(await self.packed_messages(messages, options))

    async def packed_prompt(self, prompt: str) -> bytes:
        return await self._prompt(prompt, now=False)

    async def packed_messages(
        self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS
    ) -> bytes:
        return await self._messages(messages, options, now=False)

    def prompt_now(self, prompt: str) -> bytes | None:
        """:meth:`packed_prompt` when it needs no worker thread, else None (call that)."""
        return _run_now(self._prompt(prompt, now=True))

    def messages_now(
        self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS
    ) -> bytes | None:
        """:meth:`packed_messages` when it needs no worker thread, else None (call that)."""
        return _run_now(self._messages(messages, options, now=True))

    async def _prompt(self, prompt: str, *, now: bool) -> bytes:
        wrap = self._wrap
        if wrap is None:
            return pack_ids(await self._encode(prompt, add_special_tokens=True, now=now))
        plan = self._plan(prompt, anchored=True)
        return _wrapped(await self._packed(prompt, now=now, plan=plan), wrap)

    async def _messages(
        self, messages: list[dict[str, Any]], options: ChatOptions, *, now: bool
    ) -> bytes:
        if self.chat_template is None:
            raise TokenizerError("no chat template for this model: messages cannot be encoded")
        return await self._packed(self.chat_template.render(messages, options), now=now)

    async def prompt_head(self, prompt: str, min_chars: int) -> bytes | Head:
        wrap = self._wrap
        if wrap is None:
            return await self.packed_prompt(prompt)
        got = await self._head(prompt, min_chars, anchored=True)
        if isinstance(got, bytes):
            return _wrapped(got, wrap)
        if not (wrap[0] or wrap[1]):
            return got
        rest, extra = got.rest, (len(wrap[0]) + len(wrap[1])) // 4

        async def whole() -> bytes:
            return _wrapped(await rest(), wrap)

        return Head(wrap[0] + got.packed, got.num_tokens + extra, whole)

    async def messages_head(
        self, messages: list[dict[str, Any]], options: ChatOptions, min_chars: int
    ) -> bytes | Head:
        if self.chat_template is None:
            raise TokenizerError("no chat template for this model: messages cannot be encoded")
        return await self._head(self.chat_template.render(messages, options), min_chars)

    async def _head(self, text: str, min_chars: int, *, anchored: bool = False) -> bytes | Head:
        """A :class:`Head` of ``text`` split after ``min_chars`` (at most half of it; without
        the fast path, at most CHECK_MAX_CHARS) when no kept text shares a cut with it; else
        its whole ids."""
        plan = self._plan(text, anchored=anchored)
        if not self.heads or len(text) < 2 * min_chars:
            return await self._packed(text, now=False, plan=plan)
        if plan is not None and plan.hit is not None:
            return await self._packed(text, now=False, plan=plan)
        split, ids = self._head_split(text, min_chars)
        if not ids or split is None or 2 * split > len(text):
            return await self._packed(text, now=False, plan=plan)
        self.num_heads += 1
        head = pack_ids(ids)
        estimate = max(len(ids), round(len(ids) * len(text) / split))
        # The rest is encoded from the head's end; one head in CHECK_EVERY is encoded whole.
        known = None if self.num_heads % CHECK_EVERY == 1 else (split, head)
        return Head(head, estimate, lambda: self._rest(text, head, plan, known))

    def _head_split(self, text: str, min_chars: int) -> tuple[int | None, list[int] | None]:
        # Where a head of the text ends and its ids: at a split point, else at a word head.
        split = split_point(text, min_chars, self.split_rules)
        if split is not None and 2 * split <= len(text):
            return split, self._head_ids(text[:split])
        words = self.word_heads
        if words is None:
            return None, None
        try:
            return words.head(text, min_chars) or (None, None)
        except Exception:  # the Rust binding raises a bare Exception: the whole then
            return None, None

    def _head_ids(self, head: str) -> list[int] | None:
        """The ids of a head, on the loop: the fast path's, else the tokenizer's when short."""
        fast = self.fast
        if fast is not None:
            return fast.encode(head)
        if len(head) > CHECK_MAX_CHARS:
            return None
        try:
            return encode_whole(self.tokenizer, head, add_special_tokens=False)
        except Exception:  # the Rust binding raises a bare Exception: the whole then
            return None

    async def _rest(
        self, text: str, head: bytes, plan: _Plan | None, known: tuple[int, bytes] | None
    ) -> bytes:
        """The whole ids of a text whose :class:`Head` was handed out (``plan``: its cuts, no
        kept start then; ``known``: encoded from there on); a head they do not start with
        turns heads off, logged and counted."""
        packed = await self._packed(text, now=False, plan=plan, known=known)
        if not packed.startswith(head) and self.heads:
            self.heads = False
            self.num_head_mismatches += 1
            logger.error(
                "a text's head (%d ids) differed from the start of its whole ids: texts are "
                "now encoded whole before a decision", len(head) // 4
            )  # fmt: skip
        return packed

    def _plan(self, text: str, *, anchored: bool = False) -> _Plan | None:
        """Its cuts (``anchored``: with its anchors), their digests, the longest kept start
        (None: no prefix reuse)."""
        if self.prefixes is None:
            return None
        cuts = [] if self._cuts is None else self._cuts.find(text)
        if anchored and self.anchors and len(text) > self.anchor_chars:
            cuts = self._anchored(text, cuts)
        step = self.anchor_chars
        long = step + WINDOW_SLACK < len(text) <= WORD_ANCHORS_MAX_CHARS
        if not cuts and anchored and self.word_anchors and long:
            # Each window's end names it: the text up to there makes its cut and ids.
            ends = list(range(step + WINDOW_SLACK, len(text), step))
            digests = cut_digests(text, ends, WORD_ANCHORS)
            return _Plan([], digests, self.prefixes.longest(digests), ends)
        digests = cut_digests(text, [cut.position for cut in cuts])
        return _Plan(cuts, digests, self.prefixes.longest(digests))

    def _anchored(self, text: str, cuts: list[Cut]) -> list[Cut]:
        """``cuts`` and the anchors of ``text``: each the first split point ``anchor_chars``
        past the last, so two texts alike up to one find it alike."""
        step, rules = self.anchor_chars, self.split_rules
        anchors: list[Cut] = []
        at = split_point(text, step, rules)
        while at is not None:
            anchors.append(Cut(at, None))
            at = split_point(text, at + step, rules)
        if not anchors:
            return cuts
        self.num_anchored += 1
        if self.num_anchored % CHECK_EVERY == 1 and not self._anchors_hold(text, anchors):
            return cuts
        taken = {cut.position for cut in cuts}
        merged = cuts + [a for a in anchors if a.position not in taken]
        return sorted(merged, key=_position) if cuts else merged

    async def _packed(
        self,
        text: str,
        *,
        now: bool,
        plan: _Plan | None = None,
        known: tuple[int, bytes] | None = None,
    ) -> bytes:
        """Reference: kvindex.api.tokenize.local.encode_whole; tests/unit/api/tokenize/test_prefix_reuse.py::test_reuse_equals_whole_encode

        The ids of ``text`` (no special tokens added), packed: those of the longest start a
        kept text shares, then those of each part from one cut to the next (each encoded
        alone, :mod:`.cuts`); this text is kept for the next. ``known``: a split point and
        the ids before it (a head's), encoded from there when no kept start is longer."""  # noqa: E501
        prefixes = self.prefixes
        plan = plan or self._plan(text)
        if plan is not None and plan.ends is not None:
            if self.word_anchors:
                return await self._word_packed(text, plan, now=now, known=known)
            plan = self._plan(text)  # word anchors dropped since the plan: cut as any text
        if plan is None or prefixes is None:
            start, before = known or (0, b"")
            tail = await self._encode_parts(text, [start, len(text)], now=now)
            return before + pack_ids(tail[0])
        cuts, digests, hit = plan.cuts, plan.digests, plan.hit
        first, start, before = 0, 0, b""  # the first cut in what is encoded, where, the ids before
        if hit is not None:
            first, start, before = hit.index + 1, cuts[hit.index].position, hit.packed
        elif known is not None:
            start, before = known
            first = next((i for i, cut in enumerate(cuts) if cut.position > start), len(cuts))
        bounds = [start, *(cut.position for cut in cuts[first:]), len(text)]
        parts = await self._encode_parts(text, bounds, now=now)
        starts = [cuts[first - 1] if hit is not None else None, *cuts[first:]]
        pairs = zip(starts, parts, strict=True)
        if any(cut is not None and cut.token_id is not None and ids[:1] != [cut.token_id]
               for cut, ids in pairs):  # fmt: skip
            # A part did not start with its cut's added token: this tokenizer is not cut so.
            return pack_ids(await self._encode(text, add_special_tokens=False, now=now))
        packed = b"".join([before, *map(pack_ids, parts)])
        num_tokens = len(before) // 4
        kept = [] if hit is None else list(hit.cuts)
        for digest, ids in zip(digests[first:], parts, strict=False):
            num_tokens += len(ids)
            kept.append(KeptCut(digest, num_tokens))
        prefixes.keep(packed, tuple(kept))
        self.num_reused += hit is not None
        return packed

    async def _word_packed(
        self, text: str, plan: _Plan, *, now: bool, known: tuple[int, bytes] | None
    ) -> bytes:
        """Reference: kvindex.api.tokenize.local.encode_whole; tests/unit/api/tokenize/test_word_heads.py::test_word_anchored_prompts_reuse_their_kept_starts

        :meth:`_packed` for a text cut at word anchors: the ids of the longest kept start
        up to its anchor's cut, then a head a window (:meth:`.WordHeads.anchors`), then the
        tail; kept under each window's end. One in :data:`CHECK_EVERY` is checked whole."""  # noqa: E501
        assert plan.ends is not None and self.prefixes is not None
        hit, kept = plan.hit, []
        start, before = known or (0, b"")
        if hit is not None and hit.cuts[-1].resume is not None:
            start, before, kept = hit.cuts[-1].resume, hit.packed, list(hit.cuts)
        else:
            hit = None
        first = 0 if hit is None else hit.index + 1
        inline = len(text) - start <= self.inline_max_chars
        if not inline and now:
            raise _NotNow
        self.num_anchored += 1
        check = self.num_anchored % CHECK_EVERY == 1
        run = partial(self._word_pieces, text, start, plan.ends[first:], not inline, check)
        try:
            anchors, tail, whole = run() if inline else await asyncio.to_thread(run)
        except Exception as exc:  # the Rust binding raises a bare Exception
            raise TokenizerError(f"tokenizer failed: {exc}") from exc
        packed = b"".join([before, *(pack_ids(ids) for _, _, ids in anchors), pack_ids(tail)])
        if whole is not None and whole != packed:
            self._word_anchors_failed(len(text))
            return whole
        num_tokens = len(before) // 4
        for index, cut, ids in anchors:
            num_tokens += len(ids)
            kept.append(KeptCut(plan.digests[first + index], num_tokens, cut))
        self.prefixes.keep(packed, tuple(kept))
        self.num_reused += hit is not None
        return packed

    def _word_pieces(
        self, text: str, start: int, ends: list[int], released: bool, check: bool
    ) -> tuple[list[tuple[int, int, list[int]]], list[int], bytes | None]:
        # The word anchors from ``start``, the tail's ids, and (``check``) the whole's ids.
        assert self.word_heads is not None
        anchors = self.word_heads.anchors(text, start, ends, released=released)
        at = anchors[-1][1] if anchors else start
        tail = _parts(self.tokenizer, text, [at, len(text)], False)[0]
        whole = _parts(self.tokenizer, text, [0, len(text)], False)[0] if check else None
        return anchors, tail, None if whole is None else pack_ids(whole)

    def _word_anchors_failed(self, num_chars: int) -> None:
        self.word_anchors = False
        self.num_head_mismatches += 1
        logger.error(
            "a prompt of %d characters cut at word anchors differed from its whole ids: texts "
            "are no longer cut there", num_chars
        )  # fmt: skip

    async def _encode_parts(
        self, text: str, bounds: list[int], *, now: bool, add_special_tokens: bool = False
    ) -> list[list[int]]:
        """The ids of ``text[bounds[i]:bounds[i + 1]]`` for each i: on the loop when that is
        short (``inline_max_chars``), else in a worker thread (the GIL released meanwhile;
        ``now``: raise :class:`_NotNow` instead)."""
        if self.fast is not None and not add_special_tokens:
            fast = self._fast_parts(text, bounds)
            if fast is not None:
                return fast
        tokenizer = self.tokenizer
        inline = bounds[-1] - bounds[0] <= self.inline_max_chars
        if not inline and now:
            raise _NotNow
        try:
            if inline:
                return _parts(tokenizer, text, bounds, add_special_tokens)
            return await asyncio.to_thread(_parts, tokenizer, text, bounds, add_special_tokens)
        except Exception as exc:  # the Rust binding raises a bare Exception
            raise TokenizerError(f"tokenizer failed: {exc}") from exc

    def _fast_parts(self, text: str, bounds: list[int]) -> list[list[int]] | None:
        """The parts' ids by the fast path on the loop, or None (too long, or a part it
        cannot encode): one text in :data:`CHECK_EVERY` checked against the tokenizer."""
        fast = self.fast
        if fast is None or bounds[-1] - bounds[0] > FAST_INLINE_MAX_CHARS:
            return None
        parts = []
        for a, b in itertools.pairwise(bounds):
            ids = fast.encode(text[a:b])
            if ids is None:
                return None
            parts.append(ids)
        self.num_fast += 1
        if self.num_fast % CHECK_EVERY == 1:
            self._check(text, bounds, parts)
        return parts if self.fast is not None else None

    def _anchors_hold(self, text: str, anchors: list[Cut]) -> bool:
        # Whether the parts between the anchors encode as the whole does (unknown: yes); if
        # not, heads and anchors are dropped (logged, counted).
        fast, tokenizer = self.fast, self.tokenizer
        if len(text) > (CHECK_MAX_CHARS if fast is None else FAST_INLINE_MAX_CHARS):
            return True
        encode = (
            fast.encode
            if fast is not None
            else partial(encode_whole, tokenizer, add_special_tokens=False)
        )
        bounds = [0, *(a.position for a in anchors), len(text)]
        parts = [encode(text[a:b]) for a, b in itertools.pairwise(bounds)]
        whole = encode(text)
        if whole is None or any(ids is None for ids in parts):
            return True
        if list(itertools.chain.from_iterable(p for p in parts if p is not None)) == whole:
            return True
        self.heads = self.anchors = False
        self.num_head_mismatches += 1
        logger.error(
            "a prompt cut between words (at its anchors) differed from its whole ids: texts "
            "are no longer cut there"
        )  # fmt: skip
        return False

    def _check(self, text: str, bounds: list[int], parts: list[list[int]]) -> None:
        """Drop the fast path when its ``parts`` differ from the tokenizer's."""
        try:
            expected = _parts(self.tokenizer, text, bounds, False)
        except Exception:  # the tokenizer's own failure is reported where it is used
            return
        if expected != parts:
            self.num_fast_mismatches += 1
            self.fast = None
            logger.error(
                "the fast tokenizer's ids differed from the tokenizer's on a text of %d "
                "characters (%d ids against %d): every text is now encoded by the tokenizer",
                bounds[-1] - bounds[0], sum(map(len, parts)), sum(map(len, expected)),
            )  # fmt: skip

    async def _encode(self, text: str, *, add_special_tokens: bool, now: bool) -> list[int]:
        """The ids of ``text`` encoded whole."""
        bounds = [0, len(text)]
        return (
            await self._encode_parts(text, bounds, now=now, add_special_tokens=add_special_tokens)
        )[0]


@dataclass(frozen=True, slots=True)
class _Plan:
    cuts: list[Cut]
    digests: list[bytes]
    hit: PrefixHit | None
    ends: list[int] | None = None  # word anchors' window ends (the digests'), not cuts


class _NotNow(Exception):  # noqa: N818 (a signal, not an error)
    """An encode asked for now would need a worker thread."""


def split_rules(tokenizer: tokenizers.Tokenizer) -> SplitRules:
    """The split rules the tokenizer's ids allow on samples (none: it truncates, or raises)."""
    if tokenizer.truncation is not None or tokenizer.padding is not None:
        return NONE
    added = [token.content for token in tokenizer.get_added_tokens_decoder().values()]
    encode = partial(encode_whole, tokenizer, add_special_tokens=False)
    try:
        return rules_holding(encode, [SELF_TEST], added)
    except Exception:  # the Rust binding raises a bare Exception: then no cuts
        return NONE


def special_wrap(tokenizer: tokenizers.Tokenizer) -> tuple[bytes, bytes] | None:
    """The ids (packed) the post-processor puts before and after every single text, when
    it adds the same ones around each (checked on samples); None: it does otherwise."""
    if tokenizer.num_special_tokens_to_add(is_pair=False) == 0:
        return b"", b""
    if tokenizer.truncation is not None or tokenizer.padding is not None:
        return None
    samples = (SELF_TEST, "", "a", "hello world")
    try:
        plain = [tokenizer.encode(s, add_special_tokens=False).ids for s in samples]
        whole = [tokenizer.encode(s, add_special_tokens=True).ids for s in samples]
    except Exception:  # the Rust binding raises a bare Exception: prompts encoded whole
        return None
    extra = len(whole[0]) - len(plain[0])
    start = next((i for i in range(extra + 1) if whole[0][i : i + len(plain[0])] == plain[0]), None)
    if extra < 0 or start is None:
        return None
    before, after = whole[0][:start], whole[0][start + len(plain[0]) :]
    if any(w != before + p + after for p, w in zip(plain, whole, strict=True)):
        return None
    return pack_ids(before), pack_ids(after)


def _wrapped(packed: bytes, wrap: tuple[bytes, bytes]) -> bytes:
    before, after = wrap
    return before + packed + after if before or after else packed


def _position(cut: Cut) -> int:
    return cut.position


def _run_now(coroutine: Coroutine[Any, Any, bytes]) -> bytes | None:
    """The value of a coroutine that never suspends (an encode asked for ``now``), got
    without a task or a turn of the loop; None if it would need a worker thread."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return cast(bytes, done.value)
    except _NotNow:
        return None
    coroutine.close()
    raise AssertionError("an encode asked for now suspended")


def _parts(
    tokenizer: tokenizers.Tokenizer, text: str, bounds: list[int], add_special_tokens: bool
) -> list[list[int]]:
    # One part a call: a batch of several costs more CPU (its threads); the fast batch skips
    # the offsets nothing here reads, and releases the GIL while it works.
    encode = tokenizer.encode_batch_fast
    return [
        encode([text[a:b]], add_special_tokens=add_special_tokens)[0].ids
        for a, b in itertools.pairwise(bounds)
    ]
