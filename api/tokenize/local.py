"""In-process tokenization: a ``tokenizer.json`` and the model's chat template."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Self

import tokenizers

from kvindex.api.tokenize.chat_template import ChatTemplate, load_chat_template
from kvindex.api.tokenize.protocol import TokenizerError

INLINE_MAX_CHARS = 2048
"""Texts up to this long are encoded on the event loop; longer ones in a worker thread."""


def _encode_one(tokenizer: tokenizers.Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def _encode_off_loop(
    tokenizer: tokenizers.Tokenizer, text: str, add_special_tokens: bool
) -> list[int]:
    # encode_batch releases the GIL while it works (encode does not), so the loop keeps running.
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


class LocalTokenizer:
    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: ChatTemplate | None = None,
        *,
        inline_max_chars: int = INLINE_MAX_CHARS,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.inline_max_chars = inline_max_chars

    @classmethod
    def from_files(cls, path: str | Path, chat_template_path: str | Path | None = None) -> Self:
        path = Path(path)
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust binding raises a bare Exception
            raise TokenizerError(f"tokenizer file {path}: unreadable: {exc}") from exc
        template_path = None if chat_template_path is None else Path(chat_template_path)
        return cls(tokenizer, load_chat_template(path, template_path))

    async def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of ``prompt`` with the post-processor's special tokens (e.g. BOS)."""
        return await self._encode(prompt, add_special_tokens=True)

    async def encode_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the rendered conversation; no special tokens added on top of it."""
        if self.chat_template is None:
            raise TokenizerError("no chat template for this model: messages cannot be encoded")
        return await self._encode(self.chat_template.render(messages), add_special_tokens=False)

    async def _encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        try:
            if len(text) <= self.inline_max_chars:
                return _encode_one(self.tokenizer, text, add_special_tokens)
            return await asyncio.to_thread(
                _encode_off_loop, self.tokenizer, text, add_special_tokens
            )
        except Exception as exc:  # the Rust binding raises a bare Exception
            raise TokenizerError(f"tokenizer failed: {exc}") from exc
