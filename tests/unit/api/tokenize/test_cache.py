"""kvindex.api.tokenize.cache: CachingTokenizer in front of a counting fake."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
import pytest

from kvindex.api.tokenize.cache import (
    ENTRY_OVERHEAD_BYTES,
    CachingTokenizer,
    messages_key,
    prompt_key,
)
from kvindex.api.tokenize.protocol import NO_OPTIONS, ChatOptions, Head, TokenizerError, pack_ids
from tests.unit.api.tokenize.samples import CONVERSATION


class CountingTokenizer:
    """A fake inner tokenizer: one id per character (prompts) or per message."""

    def __init__(self) -> None:
        self.calls: list[object] = []
        self.gate: asyncio.Event | None = None
        self.fail_next = False

    async def encode_prompt(self, prompt: str) -> list[int]:
        self.calls.append(prompt)
        await self._wait()
        return [ord(c) for c in prompt]

    async def encode_messages(
        self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS
    ) -> list[int]:
        self.calls.append(messages)
        await self._wait()
        return [len(str(m.get("content"))) for m in messages]

    async def _wait(self) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_next:
            self.fail_next = False
            raise TokenizerError("inner failed")


def test_cache_counts_hits_and_misses() -> None:
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner)

    async def main() -> None:
        assert await cache.encode_prompt("ab") == [97, 98]
        assert await cache.encode_prompt("ab") == [97, 98]
        assert await cache.encode_prompt("abc") == [97, 98, 99]
        assert await cache.encode_messages(CONVERSATION) == await cache.encode_messages(
            CONVERSATION
        )

    asyncio.run(main())
    assert (cache.num_hits, cache.num_misses) == (2, 3)
    assert len(inner.calls) == 3
    assert len(cache) == 3


def test_a_conversations_options_are_part_of_its_key() -> None:
    """The same messages with tools (or any option off its default) are another entry; with
    none the key is the messages' alone, as before options existed."""
    plain = messages_key(CONVERSATION)
    assert (
        plain == messages_key(CONVERSATION, NO_OPTIONS) == messages_key(CONVERSATION, ChatOptions())
    )
    tools = ChatOptions(tools=[{"type": "function", "function": {"name": "f"}}])
    keys = {
        plain,
        messages_key(CONVERSATION, tools),
        messages_key(CONVERSATION, ChatOptions(add_generation_prompt=False)),
        messages_key(CONVERSATION, ChatOptions(chat_template_kwargs={"enable_thinking": False})),
    }
    assert len(keys) == 4
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner)

    async def main() -> None:
        await cache.encode_messages(CONVERSATION)
        await cache.encode_messages(CONVERSATION, tools)
        await cache.encode_messages(CONVERSATION, tools)

    asyncio.run(main())
    assert (cache.num_misses, cache.num_hits) == (2, 1)


def test_cache_returns_copies() -> None:
    cache = CachingTokenizer(CountingTokenizer())

    async def main() -> list[int]:
        first = await cache.encode_prompt("ab")
        first.append(0)
        return await cache.encode_prompt("ab")

    assert asyncio.run(main()) == [97, 98]


def test_cache_evicts_least_recently_used() -> None:
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner, max_entries=2)

    async def main() -> None:
        for prompt in ["a", "b", "a", "c"]:  # "a" was used after "b": "b" goes
            await cache.encode_prompt(prompt)
        assert len(cache) == 2
        await cache.encode_prompt("a")
        await cache.encode_prompt("c")
        assert cache.num_misses == 3
        await cache.encode_prompt("b")

    asyncio.run(main())
    assert inner.calls == ["a", "b", "c", "b"]
    assert (cache.num_hits, cache.num_misses) == (3, 4)


def test_cache_key_covers_every_message() -> None:
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner)
    other = [*CONVERSATION[:-1], {"role": "user", "content": "and what about spain then"}]

    async def main() -> None:
        await cache.encode_messages(CONVERSATION)
        await cache.encode_messages(other)  # differs only in the last message: a miss

    asyncio.run(main())
    assert cache.num_misses == 2
    assert messages_key(CONVERSATION) != messages_key(other)
    assert messages_key(CONVERSATION[:1]) != messages_key(CONVERSATION)


def test_cache_key_is_canonical() -> None:
    reordered = [{"content": m["content"], "role": m["role"]} for m in CONVERSATION]
    assert messages_key(reordered) == messages_key(CONVERSATION)


def test_prompt_and_messages_keys_never_collide() -> None:
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner)
    text = msgspec.json.encode(CONVERSATION, order="sorted").decode()  # the canonical form

    async def main() -> None:
        await cache.encode_messages(CONVERSATION)
        await cache.encode_prompt(text)

    asyncio.run(main())
    assert cache.num_misses == 2


def test_cache_dedupes_concurrent_misses() -> None:
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner)

    async def main() -> list[list[int]]:
        inner.gate = asyncio.Event()
        calls = [asyncio.create_task(cache.encode_prompt("xy")) for _ in range(3)]
        await asyncio.sleep(0)
        inner.gate.set()
        return await asyncio.gather(*calls)

    assert asyncio.run(main()) == [[120, 121]] * 3
    assert inner.calls == ["xy"]
    assert (cache.num_hits, cache.num_misses) == (2, 1)


def test_cache_survives_cancelled_first_caller() -> None:
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner)

    async def main() -> list[int]:
        inner.gate = asyncio.Event()
        first = asyncio.create_task(cache.encode_prompt("xy"))
        second = asyncio.create_task(cache.encode_prompt("xy"))
        await asyncio.sleep(0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        inner.gate.set()
        return await second

    assert asyncio.run(main()) == [120, 121]
    assert inner.calls == ["xy"]


def test_cache_does_not_keep_errors() -> None:
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner)

    async def main() -> list[int]:
        inner.fail_next = True
        with pytest.raises(TokenizerError, match="inner failed"):
            await cache.encode_prompt("a")
        return await cache.encode_prompt("a")

    assert asyncio.run(main()) == [97]
    assert len(inner.calls) == 2


def test_cache_rejects_ids_outside_u32() -> None:
    class Negative(CountingTokenizer):
        async def encode_prompt(self, prompt: str) -> list[int]:
            return [-1]

    with pytest.raises(TokenizerError, match=r"\[0, 2\*\*32\)"):
        asyncio.run(CachingTokenizer(Negative()).encode_prompt("a"))


def test_cache_needs_room() -> None:
    with pytest.raises(TokenizerError, match="max_entries"):
        CachingTokenizer(CountingTokenizer(), max_entries=0)


def test_cache_needs_bytes() -> None:
    with pytest.raises(TokenizerError, match="max_bytes"):
        CachingTokenizer(CountingTokenizer(), max_bytes=0)


def test_keys_are_digests_not_the_input() -> None:
    long_prompt = "word " * 100_000
    conversation = [{"role": "user", "content": long_prompt}]
    assert len(prompt_key(long_prompt)) == len(messages_key(conversation)) == 16
    assert prompt_key(long_prompt) != prompt_key(long_prompt + "x")
    assert prompt_key("\ud800 lone") != prompt_key("\udc00 lone")  # surrogates from JSON


def test_cache_evicts_by_bytes() -> None:
    inner = CountingTokenizer()
    # Room for two 1,000-id entries (4,000 bytes of ids each), not for three.
    cache = CachingTokenizer(inner, max_bytes=2 * (4_000 + ENTRY_OVERHEAD_BYTES))

    async def main() -> None:
        for prompt in ["a" * 1_000, "b" * 1_000, "a" * 1_000, "c" * 1_000]:
            await cache.encode_prompt(prompt)
        assert len(cache) == 2 and cache.num_bytes == cache.max_bytes
        await cache.encode_prompt("b" * 1_000)  # "b" was the least recently used: gone

    asyncio.run(main())
    assert (cache.num_hits, cache.num_misses) == (1, 4)


def test_cache_does_not_keep_what_exceeds_its_bytes() -> None:
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner, max_bytes=4_000)

    async def main() -> list[int]:
        await cache.encode_prompt("small")
        tokens = await cache.encode_prompt("x" * 2_000)  # answered, not kept
        assert len(cache) == 1 and cache.num_bytes == 5 * 4 + ENTRY_OVERHEAD_BYTES
        await cache.encode_prompt("small")
        return tokens

    assert asyncio.run(main()) == [ord("x")] * 2_000
    assert (cache.num_hits, cache.num_misses) == (1, 2)


def test_cache_bytes_are_the_sum_of_its_entries() -> None:
    inner = CountingTokenizer()
    cache = CachingTokenizer(inner, max_entries=3, max_bytes=10_000)

    async def main() -> None:
        for size in [10, 500, 900, 20, 1_500, 5, 700]:
            await cache.encode_prompt("q" * size)
            assert cache.num_bytes <= cache.max_bytes and len(cache) <= 3

    asyncio.run(main())
    # The last three, as each fits: 1,500 + 5 + 700 ids.
    assert cache.num_bytes == (1_500 + 5 + 700) * 4 + 3 * ENTRY_OVERHEAD_BYTES


class HeadingTokenizer(CountingTokenizer):
    """The fake, answering a head (its first two ids) for prompts over ``min_chars``."""

    async def packed_prompt(self, prompt: str) -> bytes:
        return pack_ids(await self.encode_prompt(prompt))

    async def packed_messages(
        self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS
    ) -> bytes:
        return pack_ids(await self.encode_messages(messages, options))

    async def prompt_head(self, prompt: str, min_chars: int) -> bytes | Head:
        if len(prompt) <= min_chars:
            return await self.packed_prompt(prompt)
        return Head(pack_ids([ord(c) for c in prompt[:2]]), len(prompt), self._rest(prompt))

    async def messages_head(
        self, messages: list[dict[str, Any]], options: ChatOptions, min_chars: int
    ) -> bytes | Head:
        return await self.packed_messages(messages, options)

    def _rest(self, prompt: str) -> Callable[[], Coroutine[Any, Any, bytes]]:
        return lambda: self.packed_prompt(prompt)


def test_a_heads_rest_is_kept_and_a_kept_entry_is_no_head() -> None:
    inner = HeadingTokenizer()
    cache = CachingTokenizer(inner)

    async def run() -> None:
        head = await cache.prompt_head("a long prompt", 4)
        assert isinstance(head, Head) and head.packed == pack_ids([ord("a"), ord(" ")])
        assert inner.calls == []  # the head alone: nothing encoded whole yet
        whole = await head.rest()
        assert whole == pack_ids([ord(c) for c in "a long prompt"])
        assert await cache.prompt_head("a long prompt", 4) == whole
        assert await cache.messages_head(
            CONVERSATION, NO_OPTIONS, 4
        ) == await cache.packed_messages(CONVERSATION)

    asyncio.run(run())
    assert inner.calls == ["a long prompt", CONVERSATION]
    assert (cache.num_hits, cache.num_misses) == (2, 2)
