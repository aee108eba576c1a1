"""An LRU cache of tokenizations in front of any tokenizer, bounded by entries and by bytes.
Keys are 128-bit SHA-256 digests of the canonical input after a tag per kind (a crafted prompt
cannot take another's cached tokens), never the input: an entry costs its token ids (4 bytes
each) and a fixed overhead, however long the prompt's text was."""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

import msgspec

from kvindex.api.tokenize.protocol import (
    NO_OPTIONS,
    ChatOptions,
    Head,
    Tokenizer,
    TokenizerError,
    as_heading,
    as_packed,
    as_tallied,
    pack_ids,
    unpack_ids,
)

DEFAULT_MAX_BYTES = 32 * 1024 * 1024
ENTRY_OVERHEAD_BYTES = 256
"""What an entry costs besides its ids: the digest, the bytes' header, the LRU's node."""
_DIGEST_BYTES = 16


def _digest(kind: bytes, data: bytes) -> bytes:
    running = hashlib.sha256(kind)
    running.update(data)
    return running.digest()[:_DIGEST_BYTES]


def prompt_key(prompt: str) -> bytes:
    """The cache key of a completions prompt (lone surrogates kept, as JSON may carry them)."""
    return _digest(b"kvindex prompt\0", prompt.encode("utf-8", "surrogatepass"))


def messages_key(messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS) -> bytes:
    """The cache key of a conversation: the digest of its canonical JSON (object keys
    sorted, every message kept; the options not at their default after them); TokenizerError
    when it is not JSON."""
    fields = {} if options is NO_OPTIONS else options.fields()  # most chats: no options
    try:
        encoded = msgspec.json.encode([messages, fields] if fields else messages, order="sorted")
    except (TypeError, ValueError, RecursionError) as exc:
        raise TokenizerError(f"messages are not JSON-serializable: {exc}") from exc
    return _digest(b"kvindex messages\0", encoded)


def entry_bytes(packed: bytes) -> int:
    """What one entry counts against ``max_bytes``."""
    return len(packed) + ENTRY_OVERHEAD_BYTES


@runtime_checkable
class _AnswersNow(Protocol):
    """A tokenizer that may answer without awaiting (:class:`.LocalTokenizer`)."""

    def prompt_now(self, prompt: str) -> bytes | None: ...

    def messages_now(
        self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS
    ) -> bytes | None: ...


class CachingTokenizer:
    """An LRU cache of at most ``max_entries`` tokenizations and ``max_bytes`` (as
    :func:`entry_bytes` counts them) in front of another Tokenizer; a tokenization larger
    than ``max_bytes`` alone is answered but not kept. Concurrent misses of one key share
    one call of the inner tokenizer. Ids are kept packed (u32 bytes) and handed out so by
    the ``packed_*`` methods: a hit copies nothing."""

    def __init__(
        self, inner: Tokenizer, max_entries: int = 4096, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        if max_entries < 1:
            raise TokenizerError(f"max_entries must be >= 1, got {max_entries}")
        if max_bytes < 1:
            raise TokenizerError(f"max_bytes must be >= 1, got {max_bytes}")
        self.inner = inner
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_hits = 0
        self.num_misses = 0
        self.num_bytes = 0
        """What the entries kept count against ``max_bytes`` now."""
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()
        self._in_flight: dict[bytes, asyncio.Task[bytes]] = {}
        self._packed_inner = as_packed(inner)
        self._now = inner if isinstance(inner, _AnswersNow) else None
        self._heads = as_heading(inner)

    def __len__(self) -> int:
        return len(self._entries)

    def tallies(self) -> dict[str, int]:
        inner = as_tallied(self.inner)
        return {"cached": self.num_hits, **({} if inner is None else inner.tallies())}

    def features(self) -> dict[str, bool]:
        inner = as_tallied(self.inner)
        return {} if inner is None else inner.features()

    async def encode_prompt(self, prompt: str) -> list[int]:
        return unpack_ids(await self.packed_prompt(prompt))

    async def encode_messages(
        self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS
    ) -> list[int]:
        return unpack_ids(await self.packed_messages(messages, options))

    async def packed_prompt(self, prompt: str) -> bytes:
        return await self._packed_prompt(prompt_key(prompt), prompt)

    async def _packed_prompt(self, key: bytes, prompt: str) -> bytes:
        inner, packed, now = self.inner, self._packed_inner, self._now
        found = None if now is None else self._now_or_kept(key, lambda: now.prompt_now(prompt))
        if found is not None:
            return found
        if packed is not None:
            return await self._cached(key, lambda: packed.packed_prompt(prompt))
        return await self._cached(key, lambda: _packed(inner.encode_prompt(prompt)))

    async def packed_messages(
        self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS
    ) -> bytes:
        return await self._packed_messages(messages_key(messages, options), messages, options)

    async def _packed_messages(
        self, key: bytes, messages: list[dict[str, Any]], options: ChatOptions
    ) -> bytes:
        inner, packed, now = self.inner, self._packed_inner, self._now
        found = (
            None
            if now is None
            else self._now_or_kept(key, lambda: now.messages_now(messages, options))
        )
        if found is not None:
            return found
        if packed is not None:
            return await self._cached(key, lambda: packed.packed_messages(messages, options))
        return await self._cached(key, lambda: _packed(inner.encode_messages(messages, options)))

    async def prompt_head(self, prompt: str, min_chars: int) -> bytes | Head:
        heads, key = self._heads, prompt_key(prompt)
        return await self._head(
            key,
            None if heads is None else lambda: heads.prompt_head(prompt, min_chars),
            lambda: self._packed_prompt(key, prompt),
        )

    async def messages_head(
        self, messages: list[dict[str, Any]], options: ChatOptions, min_chars: int
    ) -> bytes | Head:
        heads, key = self._heads, messages_key(messages, options)
        return await self._head(
            key,
            None if heads is None else lambda: heads.messages_head(messages, options, min_chars),
            lambda: self._packed_messages(key, messages, options),
        )

    async def _head(
        self,
        key: bytes,
        head: Callable[[], Awaitable[bytes | Head]] | None,
        whole: Callable[[], Awaitable[bytes]],
    ) -> bytes | Head:
        """A kept entry, else the inner tokenizer's head (its rest kept once made), else
        the whole ids as ``packed_*`` make them."""
        packed = self._hit(key)
        if packed is not None:
            return packed
        if head is None or key in self._in_flight:
            return await whole()
        got = await head()
        if isinstance(got, bytes):
            self.num_misses += 1
            self._keep(key, got)
            return got
        return Head(got.packed, got.num_tokens, lambda: self._cached(key, got.rest))

    def _hit(self, key: bytes) -> bytes | None:
        """A kept entry (counted, made the newest), or None."""
        packed = self._entries.get(key)
        if packed is not None:
            self._entries.move_to_end(key)
            self.num_hits += 1
        return packed

    def _now_or_kept(self, key: bytes, compute: Callable[[], bytes | None]) -> bytes | None:
        """A kept entry, else the inner tokenizer's answer when it has one at once (no task:
        nothing can wait on it meanwhile); None: neither (ask :meth:`_cached`)."""
        packed = self._hit(key)
        if packed is not None:
            return packed
        if key in self._in_flight:
            return None
        packed = compute()
        if packed is not None:
            self.num_misses += 1
            self._keep(key, packed)
        return packed

    async def _cached(self, key: bytes, compute: Callable[[], Awaitable[bytes]]) -> bytes:
        packed = self._hit(key)
        if packed is not None:
            return packed
        task = self._in_flight.get(key)
        if task is None:
            self.num_misses += 1
            task = asyncio.create_task(self._fill(key, compute))
            self._in_flight[key] = task
            task.add_done_callback(lambda _: self._in_flight.pop(key, None))
        else:
            self.num_hits += 1
        return await asyncio.shield(task)

    async def _fill(self, key: bytes, compute: Callable[[], Awaitable[bytes]]) -> bytes:
        packed = await compute()
        self._keep(key, packed)
        return packed

    def _keep(self, key: bytes, packed: bytes) -> None:
        size = entry_bytes(packed)
        if size > self.max_bytes:
            return
        kept = self._entries.pop(key, None)
        if kept is not None:
            self.num_bytes -= entry_bytes(kept)
        self._entries[key] = packed
        self.num_bytes += size
        while self.num_bytes > self.max_bytes or len(self._entries) > self.max_entries:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= entry_bytes(evicted)


async def _packed(ids: Awaitable[list[int]]) -> bytes:
    return pack_ids(await ids)
