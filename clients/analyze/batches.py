"""Logged requests tokenized in batches: one call of the local tokenizer for many prompts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator
from itertools import islice

import tokenizers

from kvindex.api.tokenize.fast_bpe import FastBpe
from kvindex.api.tokenize.local import LocalTokenizer
from kvindex.api.tokenize.protocol import TokenizerError
from kvindex.clients.workloads.request_log import (
    LoggedRequest,
    LogTokenizer,
    Problems,
    TokenizedRequest,
    accepted_requests,
    tokenized,
)

BATCH_REQUESTS = 64

_Answer = list[int] | TokenizerError


async def tokenized_in_batches(
    requests: Iterator[LoggedRequest],
    tokenizer: LogTokenizer,
    problems: Problems,
    *,
    batch_size: int = BATCH_REQUESTS,
    limit: int | None = None,
) -> AsyncGenerator[TokenizedRequest]:
    """``requests`` with their token ids, as
    :func:`~kvindex.clients.workloads.request_log.tokenized` gives them; at most ``limit``,
    reading no request past the last one needed."""
    local = tokenizer.local if batch_size > 1 else None
    remaining = limit
    while remaining is None or remaining > 0:
        size = batch_size if remaining is None else min(batch_size, remaining)
        batch = list(islice(requests, size))
        if not batch:
            return
        answers = await _encoded(batch, local)
        if answers is None:  # no local tokenizer, or the library rejected the batch
            done = [d async for d in tokenized(iter(batch), tokenizer, problems)]
        else:
            done = accepted_requests(batch, answers, problems)
        for one in done:
            yield one
        if remaining is not None:
            remaining -= len(done)


async def _encoded(
    batch: list[LoggedRequest], local: LocalTokenizer | None
) -> list[_Answer] | None:
    """Each request's ids or why it has none; None: tokenize one request at a time."""
    if local is None:
        return None
    answers: list[_Answer] = [[] for _ in batch]
    special_to_texts: dict[bool, list[tuple[int, str]]] = {True: [], False: []}
    for i, request in enumerate(batch):
        if request.prompt_ids is not None:
            answers[i] = list(request.prompt_ids)
        elif request.messages is not None:
            try:
                special_to_texts[False].append((i, _rendered(local, request)))
            except TokenizerError as exc:
                answers[i] = exc
        else:
            assert request.prompt is not None  # a LoggedRequest has one of the three
            special_to_texts[True].append((i, request.prompt))
    for add_special_tokens, texts in special_to_texts.items():
        if not texts:
            continue
        try:
            ids = await asyncio.to_thread(
                _encode, local.tokenizer, local.fast, [t for _, t in texts], add_special_tokens
            )
        except Exception:  # the Rust binding raises a bare Exception
            return None
        for (i, _), one in zip(texts, ids, strict=True):
            answers[i] = one
    return answers


def _rendered(local: LocalTokenizer, request: LoggedRequest) -> str:
    assert local.chat_template is not None  # LogTokenizer gives its local tokenizer one
    assert request.messages is not None
    return local.chat_template.render(request.messages, request.chat_options)


def _encode(
    tokenizer: tokenizers.Tokenizer,
    fast: FastBpe | None,
    texts: list[str],
    add_special_tokens: bool,
) -> list[list[int]]:
    """Each text's ids: by the fast path where it applies (no special tokens added, or none
    to add), the rest in one batch of the tokenizer's."""
    if fast is None or (add_special_tokens and tokenizer.num_special_tokens_to_add(False)):
        return _batch(tokenizer, texts, add_special_tokens)
    found = [fast.encode(text) for text in texts]
    rest = [text for text, one in zip(texts, found, strict=True) if one is None]
    slow = iter(_batch(tokenizer, rest, add_special_tokens) if rest else [])
    return [next(slow) if one is None else one for one in found]


def _batch(
    tokenizer: tokenizers.Tokenizer, texts: list[str], add_special_tokens: bool
) -> list[list[int]]:
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # >= 0.20
    return [e.ids for e in encode(texts, add_special_tokens=add_special_tokens)]
