"""vLLM's render routes on the replica-sim, present as vLLM's are with ``--enable-scale-out``
(else absent: 404): the body of ``/v1/completions`` or ``/v1/chat/completions`` answered
with the prompt's ids as GenerateRequest objects (a list of one for completions, one for
chat), the ids inference runs for that body; no inference. Behind ``api_key`` as ``/v1`` is.

The replica's own pieces (its tokenizer, error shape, key check) are passed in, so this
module needs nothing of :mod:`.replica`."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Annotated, Any, Protocol

import msgspec
from fastapi import FastAPI, Request, Response

from kvindex.api.tokenize.protocol import ChatOptions, TokenId
from kvindex.clients.fake_vllm.tokenizer import ChatFields, SimTokenizerError

PromptTokens = Callable[[str | list[int]], list[int]]
ChatTokens = Callable[[list[dict[str, Any]], ChatOptions], list[int]]
Refused = Callable[[Any, Request], Response | None]
ErrorAnswer = Callable[[int, str], Response]


class Served(Protocol):
    """What the routes read of the replica's settings."""

    @property
    def model(self) -> str: ...
    @property
    def lora_names(self) -> tuple[str, ...]: ...
    @property
    def enable_scale_out(self) -> bool: ...


class _Completion(msgspec.Struct):
    model: str
    prompt: str | list[TokenId]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 16
    cache_salt: str | None = None


class _Chat(ChatFields, kw_only=True):
    model: str
    messages: list[dict[str, Any]]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 16
    cache_salt: str | None = None


def generate_request(model: str, body: _Completion | _Chat, tokens: list[int]) -> Any:
    """One of vLLM's GenerateRequest objects: the ids and the request's sampling parameters."""
    return {
        "request_id": f"render-{uuid.uuid4().hex}",
        "token_ids": tokens,
        "features": None,
        "sampling_params": {"max_tokens": body.max_tokens},
        "model": model,
        "stream": False,
        "stream_options": None,
        "cache_salt": body.cache_salt,
        "priority": 0,
        "kv_transfer_params": None,
    }


def add_render_routes(
    app: FastAPI,
    settings: Served,
    prompt_tokens: PromptTokens,
    chat_tokens: ChatTokens,
    *,
    refused: Refused,
    error: ErrorAnswer,
) -> None:
    """Both render routes on ``app`` when ``settings.enable_scale_out``; ids by
    ``prompt_tokens`` or ``chat_tokens`` (a chat's other members too), as inference's."""
    if not settings.enable_scale_out:
        return

    def render(raw: bytes, chat: bool) -> Response:
        try:
            body = msgspec.json.decode(raw, type=_Chat if chat else _Completion)
        except msgspec.DecodeError as exc:  # ValidationError included
            return error(400, str(exc))
        if body.model != settings.model and body.model not in settings.lora_names:
            return error(404, f"The model `{body.model}` does not exist.")
        try:
            if isinstance(body, _Chat):
                tokens = chat_tokens(body.messages, body.options())
                answer = generate_request(settings.model, body, tokens)
            else:
                answer = [generate_request(settings.model, body, prompt_tokens(body.prompt))]
        except SimTokenizerError as exc:
            return error(400, str(exc))
        return Response(msgspec.json.encode(answer), media_type="application/json")

    @app.post("/v1/completions/render")
    async def completions_render(request: Request) -> Response:
        return refused(settings, request) or render(await request.body(), chat=False)

    @app.post("/v1/chat/completions/render")
    async def chat_completions_render(request: Request) -> Response:
        return refused(settings, request) or render(await request.body(), chat=True)
