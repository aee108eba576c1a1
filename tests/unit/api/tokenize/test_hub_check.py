"""kvindex.api.tokenize.hub_check: a hub-found tokenizer is trusted until the model's replicas
encode the probe otherwise; unanswered, it is checked again after RETRY_S."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvindex.api.tokenize import hub_check
from kvindex.api.tokenize.hub_check import HubCheck
from kvindex.api.tokenize.protocol import NO_OPTIONS, ChatOptions, TokenizerError


class Ids:
    """A tokenizer answering ``prompt`` and ``chat`` ids, or failing; counts its calls."""

    def __init__(self, prompt: list[int], chat: list[int], *, fails: bool = False) -> None:
        self.prompt, self.chat, self.fails, self.calls = prompt, chat, fails, 0

    async def encode_prompt(self, prompt: str) -> list[int]:
        self.calls += 1
        if self.fails:
            raise TokenizerError("no replica answered")
        return self.prompt

    async def encode_messages(
        self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS
    ) -> list[int]:
        return self.chat


async def _checked(check: HubCheck, local: Ids, replicas: Ids) -> bool:
    trusted = check.trusted("m", local, replicas)
    await asyncio.sleep(0)  # the check runs
    await asyncio.sleep(0)
    return trusted


@pytest.mark.parametrize(
    ("replicas", "kept"),
    [(Ids([1, 2], [3]), True), (Ids([1, 2], [4]), False), (Ids([9], [3]), False)],
)
def test_the_local_tokenizer_is_kept_while_the_replicas_agree(replicas: Ids, kept: bool) -> None:
    local, check = Ids([1, 2], [3]), HubCheck()

    async def run() -> None:
        assert await _checked(check, local, replicas)  # trusted until checked
        assert check.trusted("m", local, replicas) is kept
        assert check.trusted("m", local, replicas) is kept
        await check.aclose()

    asyncio.run(run())
    assert replicas.calls == 1  # checked once


def test_unanswered_it_is_kept_and_checked_again_later(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    check, local = HubCheck(clock=lambda: now[0]), Ids([1], [2])
    replicas = Ids([7], [7], fails=True)

    async def run() -> None:
        assert await _checked(check, local, replicas)
        assert await _checked(check, local, replicas)  # not due again yet
        assert replicas.calls == 1
        now[0] = hub_check.RETRY_S
        replicas.fails = False
        assert await _checked(check, local, replicas)
        assert replicas.calls == 2
        assert check.trusted("m", local, replicas) is False
        check.forget("m")
        assert await _checked(check, local, replicas)  # a forgotten model is checked anew
        assert replicas.calls == 3
        await check.aclose()

    asyncio.run(run())


def test_without_a_running_loop_nothing_is_checked() -> None:
    check, local, replicas = HubCheck(), Ids([1], [2]), Ids([7], [7])
    assert check.trusted("m", local, replicas)
    assert replicas.calls == 0
