"""A replica-sim's tokenizer: a toy one (a word a token) or a real ``tokenizer.json``."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import msgspec
import xxhash

from kvindex.api.tokenize.local import LocalTokenizer
from kvindex.api.tokenize.protocol import NO_OPTIONS, ChatOptions, TokenizerError
from kvindex.indexer.domain.errors import KvIndexError

VOCAB_SIZE = 50_000
"""Toy vocabulary: a word's token id is a stable hash of it modulo this."""


class SimTokenizerError(KvIndexError):
    """A tokenizer file that cannot be read, or messages its template refuses."""


def word_token(word: str) -> int:
    return xxhash.xxh3_64_intdigest(word.encode()) % VOCAB_SIZE


def tokenize_text(text: str) -> list[int]:
    """Toy tokenizer: one token per whitespace-separated word (deterministic everywhere)."""
    return [word_token(word) for word in text.split()]


class ChatFields(msgspec.Struct, kw_only=True):
    """The members of a chat body (completions, ``/tokenize``, render) besides its messages
    that its template renders, as vLLM reads them."""

    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def options(self) -> ChatOptions:
        return ChatOptions(
            self.tools,
            self.documents,
            self.chat_template_kwargs,
            self.add_generation_prompt,
            self.continue_final_message,
        )


def render_chat(messages: Sequence[dict[str, Any]], options: ChatOptions = NO_OPTIONS) -> str:
    """A minimal chat template over ALL messages: ``<|role|> content`` each, after the tools
    and documents as JSON (the generation prompt last unless told)."""
    parts = [
        f"<|{name}|> {msgspec.json.encode(value).decode()}"
        for name, value in (("tools", options.tools), ("documents", options.documents))
        if value
    ]
    parts += [f"<|{m.get('role', 'user')}|> {m.get('content') or ''}" for m in messages]
    if options.add_generation_prompt:
        parts.append("<|assistant|>")
    return " ".join(parts)


class SimTokenizer:
    """What the sim tokenizes with: the toy tokenizer (``path`` None), or a ``tokenizer.json``
    and its chat template as vLLM uses them (a prompt gets the special tokens its
    post-processor adds, a rendered conversation none); SimTokenizerError when unreadable."""

    def __init__(self, path: str | None = None, chat_template: str | None = None) -> None:
        self.local: LocalTokenizer | None = None
        if path is not None:
            try:
                self.local = LocalTokenizer.from_files(path, chat_template, prefix_cache_bytes=0)
            except TokenizerError as exc:
                raise SimTokenizerError(f"tokenizer: {exc}") from exc

    def text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.local is None:
            return tokenize_text(text)
        return self.local.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def chat(self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS) -> list[int]:
        """SimTokenizerError when the template refuses the messages."""
        local = self.local
        if local is None:
            return tokenize_text(render_chat(messages, options))
        if local.chat_template is None:
            raise SimTokenizerError("the model has no chat template: messages cannot be encoded")
        try:
            rendered = local.chat_template.render(messages, options)
        except TokenizerError as exc:
            raise SimTokenizerError(str(exc)) from exc
        return self.text(rendered, add_special_tokens=False)


@functools.cache
def sim_tokenizer(path: str | None, chat_template: str | None) -> SimTokenizer:
    """The one SimTokenizer of a file (loaded once per process)."""
    return SimTokenizer(path, chat_template)
