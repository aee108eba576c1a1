"""In-process tokenization: a ``tokenizer.json`` and the model's chat template, reusing the
ids of a text's start that an earlier text shared (:mod:`.prefix_cache`)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Self

import tokenizers

from kvindex.api.tokenize.chat_template import ChatTemplate, load_chat_template
from kvindex.api.tokenize.cuts import Cut, Cuts
from kvindex.api.tokenize.prefix_cache import KeptCut, PrefixCache, PrefixHit, cut_digests
from kvindex.api.tokenize.protocol import TokenizerError, pack_ids, unpack_ids

INLINE_MAX_CHARS = 2048
"""Texts up to this long are encoded on the event loop; longer ones in a worker thread."""
DEFAULT_PREFIX_CACHE_BYTES = 32 * 1024 * 1024


def _encode_one(
    tokenizer: tokenizers.Tokenizer, text: str, add_special_tokens: bool
) -> tokenizers.Encoding:
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _encode_off_loop(
    tokenizer: tokenizers.Tokenizer, text: str, add_special_tokens: bool
) -> tokenizers.Encoding:
    # encode_batch releases the GIL while it works (encode does not), so the loop keeps running.
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]


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
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.inline_max_chars = inline_max_chars
        self.num_reused = 0
        """Texts encoded from a kept prefix (the rest encoded whole)."""
        cuts = Cuts.of(tokenizer) if prefix_cache_bytes > 0 else None
        self._cuts = cuts
        self.prefixes = PrefixCache(prefix_cache_bytes) if cuts is not None else None
        # A prompt's ids are reused only when the post-processor adds none (no BOS, no EOS).
        self._prompt_reuse = tokenizer.num_special_tokens_to_add(is_pair=False) == 0

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

    async def encode_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the rendered conversation; no special tokens added on top of it."""
        return unpack_ids(await self.packed_messages(messages))

    async def packed_prompt(self, prompt: str) -> bytes:
        if self._prompt_reuse:
            return await self._packed(prompt)
        return pack_ids((await self._encode(prompt, add_special_tokens=True)).ids)

    async def packed_messages(self, messages: list[dict[str, Any]]) -> bytes:
        if self.chat_template is None:
            raise TokenizerError("no chat template for this model: messages cannot be encoded")
        return await self._packed(self.chat_template.render(messages))

    async def _packed(self, text: str) -> bytes:
        """Reference: kvindex.api.tokenize.local.encode_whole; tests/unit/api/tokenize/test_prefix_reuse.py::test_reuse_equals_whole_encode

        The ids of ``text`` (no special tokens added), packed; encodes only what follows the
        longest cut a kept text shares, and keeps this text for the next."""  # noqa: E501
        prefixes = self.prefixes
        if self._cuts is None or prefixes is None:
            return pack_ids((await self._encode(text, add_special_tokens=False)).ids)
        cuts = self._cuts.find(text)
        digests = cut_digests(text, [cut.position for cut in cuts])
        hit = prefixes.longest(digests)
        if hit is not None:
            found = await self._after(text, cuts, digests, hit)
            if found is not None:
                self.num_reused += 1
                prefixes.keep(*found)
                return found[0]
        encoding = await self._encode(text, add_special_tokens=False)
        ids = encoding.ids
        packed = pack_ids(ids)
        prefixes.keep(
            packed, _kept(encoding, ids, offset=0, num_before=0, cuts=cuts, digests=digests)
        )
        return packed

    async def _after(
        self, text: str, cuts: list[Cut], digests: list[bytes], hit: PrefixHit
    ) -> tuple[bytes, tuple[KeptCut, ...]] | None:
        """The ids of ``text`` with the hit's and those of the rest, and the cuts to keep
        (None: the cut's added token is not the first token of the rest)."""
        start = cuts[hit.index]
        encoding = await self._encode(text[start.position :], add_special_tokens=False)
        ids = encoding.ids
        if not ids or ids[0] != start.token_id:
            return None
        num_before, after = len(hit.packed) // 4, hit.index + 1
        later = _kept(
            encoding,
            ids,
            offset=start.position,
            num_before=num_before,
            cuts=cuts[after:],
            digests=digests[after:],
        )
        return hit.packed + pack_ids(ids), hit.cuts + later

    async def _encode(self, text: str, *, add_special_tokens: bool) -> tokenizers.Encoding:
        try:
            if len(text) <= self.inline_max_chars:
                return _encode_one(self.tokenizer, text, add_special_tokens)
            return await asyncio.to_thread(
                _encode_off_loop, self.tokenizer, text, add_special_tokens
            )
        except Exception as exc:  # the Rust binding raises a bare Exception
            raise TokenizerError(f"tokenizer failed: {exc}") from exc


def _kept(
    encoding: tokenizers.Encoding,
    ids: list[int],
    *,
    offset: int,
    num_before: int,
    cuts: list[Cut],
    digests: list[bytes],
) -> tuple[KeptCut, ...]:
    """The cuts of an encoding of ``text[offset:]`` (its ``ids`` following ``num_before``
    others) where the cut's added token is the token starting there; others are not kept."""
    kept = []
    for cut, digest in zip(cuts, digests, strict=True):
        position = cut.position - offset
        index = encoding.char_to_token(position)
        if index is None or ids[index] != cut.token_id:
            continue
        span = encoding.token_to_chars(index)
        if span is not None and span[0] == position:  # the token starts at the cut
            kept.append(KeptCut(digest, num_before + index))
    return tuple(kept)
