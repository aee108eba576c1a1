"""What every tokenizer promises, and the one error it may raise."""

from __future__ import annotations

from typing import Annotated, Any, Protocol

import msgspec

from kvindex.indexer.domain.errors import KvIndexError

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
"""A token id as engines hash it (unsigned 32-bit)."""


class TokenizerError(KvIndexError):
    """Text or messages could not be tokenized; the message says which model source and why."""


class Tokenizer(Protocol):
    """A prompt or a conversation → the token ids one model's engine sees; TokenizerError."""

    async def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a completions prompt, special tokens (e.g. BOS) added."""
        ...

    async def encode_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """The conversation rendered by the chat template, generation prompt added."""
        ...
