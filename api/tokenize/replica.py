"""Tokenization by a vLLM replica's own ``POST /tokenize``: the engine's exact tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec

from kvindex.api.tokenize.protocol import TokenId, TokenizerError

_EXCERPT_CHARS = 200
_JSON_HEADERS = {"content-type": "application/json"}


class _TokenizeResponse(msgspec.Struct):
    tokens: list[TokenId]


def _excerpt(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _EXCERPT_CHARS else flat[:_EXCERPT_CHARS] + "…"


class ReplicaTokenizer:
    """Tokenizes through a vLLM replica's ``POST {base_url}/tokenize``."""

    def __init__(
        self, client: httpx.AsyncClient, base_url: str, model: str, *, timeout_s: float = 5.0
    ) -> None:
        self.client = client
        self.url = base_url.rstrip("/") + "/tokenize"
        self.model = model
        self.timeout_s = timeout_s

    async def encode_prompt(self, prompt: str) -> list[int]:
        """Completions tokens (``add_special_tokens`` true); TokenizerError when it fails."""
        body = {"model": self.model, "prompt": prompt, "add_special_tokens": True}
        return await self._tokenize(body)

    async def encode_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        body = {
            "model": self.model,
            "messages": messages,
            "add_generation_prompt": True,
            "add_special_tokens": False,
        }
        return await self._tokenize(body)

    async def _tokenize(self, body: dict[str, Any]) -> list[int]:
        status, answer = await self._post(body)
        if status >= 400:
            raise TokenizerError(f"{self.url}: HTTP {status}: {_excerpt(_text(answer))}")
        try:
            return msgspec.json.decode(answer, type=_TokenizeResponse).tokens
        except msgspec.DecodeError as exc:
            raise TokenizerError(
                f"{self.url}: malformed response ({exc}): {_excerpt(_text(answer))}"
            ) from exc

    async def _post(self, body: dict[str, Any]) -> tuple[int, bytes]:
        """The answer's status and body. Neither the request's JSON nor the answer is left
        to httpx: its Response and the Response's stream refer to each other, so what they
        hold (a prompt's JSON, its tokens) would live on until the cycle collector ran."""
        try:
            content = msgspec.json.encode(body)
        except (TypeError, ValueError) as exc:
            raise TokenizerError(f"{self.url}: request is not JSON-serializable: {exc}") from exc
        headers = {**_JSON_HEADERS, "content-length": str(len(content))}
        request = self.client.build_request(
            "POST", self.url, content=_sent_once(content), headers=headers, timeout=self.timeout_s
        )
        del content  # the generator holds it until sent
        try:
            response = await self.client.send(request, stream=True)
            try:
                chunks = [chunk async for chunk in response.aiter_bytes()]
            finally:
                await response.aclose()
        except httpx.TimeoutException as exc:
            raise TokenizerError(f"{self.url}: timed out after {self.timeout_s} s") from exc
        except httpx.RequestError as exc:
            raise TokenizerError(f"{self.url}: unreachable: {exc!r}") from exc
        return response.status_code, b"".join(chunks)


async def _sent_once(content: bytes) -> AsyncIterator[bytes]:
    """``content`` as a request body that lets go of it once it is sent (the Content-Length
    header is set beside it, so the body is not chunked)."""
    yield content


def _text(answer: bytes) -> str:
    return answer.decode("utf-8", "replace")
