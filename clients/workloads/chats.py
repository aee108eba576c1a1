"""Closed-loop chats (:class:`ChatSessions`): a chat's next turn waits for its last one to end."""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

CHAT_VOCAB = 128_256
"""Llama 3's vocabulary (about half of the token ids need a 5-byte msgpack integer)."""
MAX_CHAT_TOKENS = 6_144
"""A chat ends once its history is this long."""
_CHAT_PROMPT_BLOCKS = (20, 60)
_CHAT_USER_TOKENS = (32, 768)
_CHAT_OUTPUT_TOKENS = (32, 512)
_CHAT_TURNS = (1, 8)
_P_CONTINUE = 0.7
"""Chance that the next request is another turn of an idle chat."""


def random_tokens(rng: random.Random, count: int) -> list[int]:
    """``count`` token ids below :data:`CHAT_VOCAB`, drawn as bytes (fast for long prompts)."""
    return [t % CHAT_VOCAB for t in array("I", rng.randbytes(count * 4))]


def chat_system_prompts(seed: int, count: int, block_size: int = 16) -> list[list[int]]:
    """``count`` system prompts of tens of blocks each (not block-aligned), from ``seed``."""
    rng = random.Random(seed)
    low, high = _CHAT_PROMPT_BLOCKS
    return [
        random_tokens(rng, rng.randint(low, high) * block_size + rng.randrange(block_size))
        for _ in range(count)
    ]


@dataclass(slots=True, eq=False)
class Chat:
    """One conversation: its history so far, behind one of the system prompts."""

    system_prompt: int
    """Index of the system prompt it started from."""
    tokens: list[int]
    turns_left: int


@dataclass(frozen=True, slots=True, eq=False)
class ChatTurn:
    """One request: the chat's history, a new user message, then the answer (drawn up front)."""

    chat: Chat
    tokens: list[int]
    """Prompt then output."""
    num_prompt_tokens: int


class ChatSessions:
    """Chats for one replica: a function of ``rng`` and the call order."""

    def __init__(
        self, rng: random.Random, system_prompts: Sequence[list[int]], *, max_idle: int
    ) -> None:
        self._rng = rng
        self._prompts = system_prompts
        self._weights = [1.0 / (i + 1) for i in range(len(system_prompts))]
        self._max_idle = max_idle
        self._idle: list[Chat] = []

    def next_turn(self) -> ChatTurn:
        chat = self._pick()
        rng = self._rng
        user = random_tokens(rng, rng.randint(*_CHAT_USER_TOKENS))
        output = random_tokens(rng, rng.randint(*_CHAT_OUTPUT_TOKENS))
        return ChatTurn(chat, chat.tokens + user + output, len(chat.tokens) + len(user))

    def end_turn(self, turn: ChatTurn) -> bool:
        """The turn is answered: it joins the chat's history. True if the chat goes on."""
        chat = turn.chat
        chat.tokens = turn.tokens
        chat.turns_left -= 1
        if chat.turns_left > 0 and len(turn.tokens) < MAX_CHAT_TOKENS:
            self._idle.append(chat)
            return True
        return False

    def _pick(self) -> Chat:
        idle, rng = self._idle, self._rng
        if idle and (len(idle) >= self._max_idle or rng.random() < _P_CONTINUE):
            i = rng.randrange(len(idle))
            idle[i], idle[-1] = idle[-1], idle[i]
            return idle.pop()
        index = rng.choices(range(len(self._prompts)), self._weights)[0]
        return Chat(index, list(self._prompts[index]), rng.randint(*_CHAT_TURNS))
