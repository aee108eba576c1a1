"""The replica-sim's engine-free answers (``/tokenize``, ``/v1/embeddings``), vLLM's error shape."""

from __future__ import annotations

from typing import Any, Protocol

import msgspec
from fastapi import Response

from kvindex.api.tokenize.protocol import TokenId
from kvindex.clients.fake_vllm.tokenizer import (
    ChatFields,
    SimTokenizer,
    SimTokenizerError,
    sim_tokenizer,
)

_json = msgspec.json.encode


class TokenSettings(Protocol):
    """What these routes read of the replica's settings."""

    @property
    def model(self) -> str: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def tokenizer(self) -> str | None: ...
    @property
    def chat_template(self) -> str | None: ...


class TokenizeBody(ChatFields, kw_only=True):
    model: str | None = None
    prompt: str | list[TokenId] | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True


def error_answer(status: int, message: str) -> Response:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    body = {"object": "error", "message": message, "type": kind, "code": status}
    return Response(_json(body), status_code=status, media_type="application/json")


def ok_answer(body: object) -> Response:
    return Response(_json(body), media_type="application/json")


def prompt_tokens(
    prompt: str | list[int], tokenizer: SimTokenizer | None = None, add_special_tokens: bool = True
) -> list[int]:
    if not isinstance(prompt, str):
        return list(prompt)
    return (tokenizer or sim_tokenizer(None, None)).text(prompt, add_special_tokens)


def handle_tokenize(settings: TokenSettings, raw: bytes) -> Response:
    """``POST /tokenize``: ``prompt`` or ``messages`` → ``{count, max_model_len, tokens}``."""
    try:
        body = msgspec.json.decode(raw, type=TokenizeBody)
    except msgspec.DecodeError as exc:
        return error_answer(400, str(exc))
    tokenizer = sim_tokenizer(settings.tokenizer, settings.chat_template)
    try:
        if body.messages is not None:
            tokens = tokenizer.chat(body.messages, body.options())
        elif body.prompt is not None:
            tokens = prompt_tokens(body.prompt, tokenizer, body.add_special_tokens)
        else:
            return error_answer(400, "either prompt or messages is required")
    except SimTokenizerError as exc:
        return error_answer(400, str(exc))
    return ok_answer(
        {"count": len(tokens), "max_model_len": settings.max_model_len, "tokens": tokens}
    )


class EmbeddingBody(msgspec.Struct):
    model: str
    input: str | list[str]


EMBEDDING_SIZE = 8


def handle_embeddings(settings: TokenSettings, raw: bytes) -> Response:
    """``POST /v1/embeddings``: each input's toy tokens folded into a normalised vector."""
    try:
        body = msgspec.json.decode(raw, type=EmbeddingBody)
    except msgspec.DecodeError as exc:
        return error_answer(400, str(exc))
    if body.model != settings.model:
        return error_answer(404, f"The model `{body.model}` does not exist.")
    texts = [body.input] if isinstance(body.input, str) else body.input
    data, num_tokens = [], 0
    for i, text in enumerate(texts):
        tokens = sim_tokenizer(settings.tokenizer, settings.chat_template).text(text)
        num_tokens += len(tokens)
        counts = [0.0] * EMBEDDING_SIZE
        for token in tokens:
            counts[token % EMBEDDING_SIZE] += 1.0
        norm = sum(c * c for c in counts) ** 0.5 or 1.0
        vector = [c / norm for c in counts]
        data.append({"object": "embedding", "index": i, "embedding": vector})
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    return ok_answer({"object": "list", "data": data, "model": body.model, "usage": usage})
