"""kvindex.api.tokenize.cache: CachingTokenizer in front of a counting fake."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvindex.api.tokenize.cache import CachingTokenizer, messages_key
from kvindex.api.tokenize.protocol import TokenizerError
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

    async def encode_messages(self, messages: list[dict[str, Any]]) -> list[int]:
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
    text = messages_key(CONVERSATION).decode()

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
