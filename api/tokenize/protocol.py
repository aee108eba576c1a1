"""What every tokenizer promises, and the one error it may raise; token ids packed as u32."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Protocol, cast

import msgspec

from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.keys import BlockKeyError, tokens_to_bytes

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
"""A token id as engines hash it (unsigned 32-bit)."""


class ChatOptions(msgspec.Struct, frozen=True, omit_defaults=True):
    """What of a chat request besides its messages changes the text its engine renders: the
    fields of vLLM's chat completions and ``/tokenize`` of the same names."""

    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def fields(self) -> dict[str, Any]:
        """The members not at their default, as a request body carries them."""
        return {name: getattr(self, name) for name in _OPTION_NAMES if _set(self, name)}


_OPTION_NAMES = ChatOptions.__struct_fields__
_DEFAULTS = ChatOptions()


def _set(options: ChatOptions, name: str) -> bool:
    return bool(getattr(options, name) != getattr(_DEFAULTS, name))


NO_OPTIONS = _DEFAULTS
"""A conversation rendered as its messages alone, the generation prompt added."""

_OPTION_TYPES = {
    "tools": list,
    "documents": list,
    "chat_template_kwargs": dict,
    "add_generation_prompt": bool,
    "continue_final_message": bool,
}


def chat_options_of(body: Mapping[str, Any]) -> ChatOptions:
    """An OpenAI chat body's options; a member of another type is left out (its engine refuses)."""
    found: dict[str, Any] = {}
    for name, kind in _OPTION_TYPES.items():
        value = body.get(name)
        if isinstance(value, list) and not all(isinstance(v, dict) for v in value):
            continue
        if isinstance(value, kind):
            found[name] = value
    return ChatOptions(**found) if found else NO_OPTIONS


class TokenizerError(KvIndexError):
    """Text or messages could not be tokenized; the message says which model source and why."""


class Tokenizer(Protocol):
    """A prompt or a conversation → the token ids one model's engine sees; TokenizerError."""

    async def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a completions prompt, special tokens (e.g. BOS) added."""
        ...

    async def encode_messages(
        self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS
    ) -> list[int]:
        """The conversation rendered by the chat template as ``options`` say."""
        ...


class PackedTokenizer(Tokenizer, Protocol):
    """A Tokenizer that also answers with the ids as u32 bytes, which block keys chain over."""

    async def packed_prompt(self, prompt: str) -> bytes:
        """:meth:`encode_prompt`'s ids, packed (:func:`pack_ids`)."""
        ...

    async def packed_messages(
        self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS
    ) -> bytes:
        """:meth:`encode_messages`'s ids, packed (:func:`pack_ids`)."""
        ...


@dataclass(frozen=True, slots=True)
class Head:
    """The ids of a long text's start, exactly the whole text's first ids, when no kept text
    starts as it does: enough to ask the index whether any replica holds its first block."""

    packed: bytes
    num_tokens: int
    """The whole text's tokens, estimated (the head's tokens per character)."""
    rest: Callable[[], Coroutine[Any, Any, bytes]]
    """The whole text's ids, packed (and kept for the next text, as any encode's)."""


class HeadTokenizer(PackedTokenizer, Protocol):
    """A PackedTokenizer that can answer with a :class:`Head` of a text whose start it has
    not seen (longer than ``min_chars`` twice over); the whole ids otherwise."""

    async def prompt_head(self, prompt: str, min_chars: int) -> bytes | Head: ...

    async def messages_head(
        self, messages: list[dict[str, Any]], options: ChatOptions, min_chars: int
    ) -> bytes | Head: ...


def as_heading(tokenizer: Tokenizer) -> HeadTokenizer | None:
    """``tokenizer`` when it is a HeadTokenizer, else None."""
    if getattr(tokenizer, "messages_head", None) is None:
        return None
    return cast(HeadTokenizer, tokenizer)


class Tallied(Protocol):
    """A tokenizer in process that counts what it did (its metrics)."""

    def tallies(self) -> dict[str, int]: ...  # texts by how they were encoded, since start
    def features(self) -> dict[str, bool]: ...  # which of its shortcuts are on now


def as_tallied(tokenizer: Tokenizer) -> Tallied | None:
    """``tokenizer`` when it is Tallied, else None."""
    if getattr(tokenizer, "tallies", None) is None:
        return None
    return cast(Tallied, tokenizer)


def as_packed(tokenizer: Tokenizer) -> PackedTokenizer | None:
    """``tokenizer`` when it is a PackedTokenizer, else None."""
    # One attribute read: an isinstance of a runtime-checkable Protocol walks its members.
    if getattr(tokenizer, "packed_messages", None) is None:
        return None
    return cast(PackedTokenizer, tokenizer)


def pack_ids(token_ids: list[int]) -> bytes:
    """Token ids as little-endian u32 bytes; TokenizerError for an id outside u32."""
    try:
        return tokens_to_bytes(token_ids)
    except BlockKeyError as exc:
        raise TokenizerError(str(exc)) from exc


def unpack_ids(packed: bytes) -> list[int]:
    """The ids :func:`pack_ids` packed."""
    ids = array("I", packed)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tolist()
