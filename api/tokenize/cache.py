"""An LRU cache of tokenizations in front of any tokenizer."""

from __future__ import annotations

import asyncio
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

import msgspec

from kvindex.api.tokenize.protocol import Tokenizer, TokenizerError

_Packed: TypeAlias = "array[int]"  # token ids as u32: 4 bytes each, a list needs 8 + 28


def _pack(tokens: list[int]) -> _Packed:
    try:
        return array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise TokenizerError(f"token ids must be integers in [0, 2**32): {exc}") from exc


def messages_key(messages: list[dict[str, Any]]) -> bytes:
    """A canonical encoding of a conversation: JSON, object keys sorted, every message kept."""
    try:
        return msgspec.json.encode(messages, order="sorted")
    except (TypeError, ValueError) as exc:
        raise TokenizerError(f"messages are not JSON-serializable: {exc}") from exc


class CachingTokenizer:
    """An LRU cache of at most ``max_entries`` tokenizations in front of another Tokenizer."""

    def __init__(self, inner: Tokenizer, max_entries: int = 4096) -> None:
        if max_entries < 1:
            raise TokenizerError(f"max_entries must be >= 1, got {max_entries}")
        self.inner = inner
        self.max_entries = max_entries
        self.num_hits = 0
        self.num_misses = 0
        self._entries: OrderedDict[str | bytes, _Packed] = OrderedDict()
        self._in_flight: dict[str | bytes, asyncio.Task[_Packed]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    async def encode_prompt(self, prompt: str) -> list[int]:
        return await self._cached(prompt, lambda: self.inner.encode_prompt(prompt))

    async def encode_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        key = messages_key(messages)
        return await self._cached(key, lambda: self.inner.encode_messages(messages))

    async def _cached(
        self, key: str | bytes, compute: Callable[[], Awaitable[list[int]]]
    ) -> list[int]:
        packed = self._entries.get(key)
        if packed is not None:
            self._entries.move_to_end(key)
            self.num_hits += 1
            return packed.tolist()
        task = self._in_flight.get(key)
        if task is None:
            self.num_misses += 1
            task = asyncio.create_task(self._fill(key, compute))
            self._in_flight[key] = task
            task.add_done_callback(lambda _: self._in_flight.pop(key, None))
        else:
            self.num_hits += 1
        return (await asyncio.shield(task)).tolist()

    async def _fill(self, key: str | bytes, compute: Callable[[], Awaitable[list[int]]]) -> _Packed:
        packed = _pack(await compute())
        self._entries[key] = packed
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return packed
