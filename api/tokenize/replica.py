"""Tokenization by a vLLM replica's own ``POST /tokenize``: the engine's exact tokens."""

from __future__ import annotations

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
        response = await self._post(body)
        if response.is_error:
            raise TokenizerError(
                f"{self.url}: HTTP {response.status_code}: {_excerpt(response.text)}"
            )
        try:
            return msgspec.json.decode(response.content, type=_TokenizeResponse).tokens
        except msgspec.DecodeError as exc:
            raise TokenizerError(
                f"{self.url}: malformed response ({exc}): {_excerpt(response.text)}"
            ) from exc

    async def _post(self, body: dict[str, Any]) -> httpx.Response:
        try:
            content = msgspec.json.encode(body)
        except (TypeError, ValueError) as exc:
            raise TokenizerError(f"{self.url}: request is not JSON-serializable: {exc}") from exc
        try:
            return await self.client.post(
                self.url, content=content, headers=_JSON_HEADERS, timeout=self.timeout_s
            )
        except httpx.TimeoutException as exc:
            raise TokenizerError(f"{self.url}: timed out after {self.timeout_s} s") from exc
        except httpx.RequestError as exc:
            raise TokenizerError(f"{self.url}: unreachable: {exc!r}") from exc
