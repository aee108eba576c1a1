"""kvindex.clients.workloads.chats."""

from __future__ import annotations

import random

from kvindex.clients.workloads.chats import (
    CHAT_VOCAB,
    MAX_CHAT_TOKENS,
    ChatSessions,
    chat_system_prompts,
)


def chat_sessions(seed: int = 0, max_idle: int = 8) -> ChatSessions:
    return ChatSessions(random.Random(seed), chat_system_prompts(seed, 3), max_idle=max_idle)


def test_chat_system_prompts_are_seeded_and_tens_of_blocks_long() -> None:
    prompts = chat_system_prompts(0, 3)
    assert prompts == chat_system_prompts(0, 3) != chat_system_prompts(1, 3)
    assert all(20 * 16 <= len(p) < 61 * 16 for p in prompts)
    assert all(0 <= t < CHAT_VOCAB for p in prompts for t in p)


def test_a_chat_comes_back_with_its_whole_history_until_it_is_done() -> None:
    sessions = chat_sessions(max_idle=1)  # one idle chat is always picked next
    turn = sessions.next_turn()
    assert turn.tokens[: len(turn.chat.tokens)] == turn.chat.tokens  # the history, then more
    turns = 1
    while sessions.end_turn(turn):
        history = turn.tokens
        turn = sessions.next_turn()
        assert turn.tokens[: len(history)] == history  # the same chat, answers included
        assert turn.num_prompt_tokens > len(history)
        turns += 1
    assert turns <= 8
    assert turn.chat.turns_left == 0 or len(turn.tokens) >= MAX_CHAT_TOKENS
    assert sessions.next_turn().chat is not turn.chat  # a finished chat never comes back


def test_chat_sessions_are_a_function_of_the_seed() -> None:
    def tokens(seed: int) -> list[list[int]]:
        sessions = chat_sessions(seed)
        out = []
        for _ in range(20):
            turn = sessions.next_turn()
            sessions.end_turn(turn)
            out.append(turn.tokens)
        return out

    assert tokens(3) == tokens(3) != tokens(4)
