"""Tokenization by a vLLM replica: its render routes (``--enable-scale-out``: the engine's own
ids) when served, else ``POST /tokenize``; ``auto`` falls back per replica on
:data:`NOT_SERVED` for :data:`RENDER_REPROBE_S`, then asks render again."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal, get_args

import httpx
import msgspec

from kvindex.api.loop.probe import Probes
from kvindex.api.tokenize.protocol import NO_OPTIONS, ChatOptions, TokenId, TokenizerError

ReplicaRoute = Literal["auto", "render", "tokenize"]
"""``auto``: render when the replica serves it, else ``/tokenize``; the others: that one only."""
RENDER_REPROBE_S = 60.0
"""How long a replica without render routes is sent to ``/tokenize`` before render is retried."""
NOT_SERVED = frozenset({401, 403, 404, 405, 501})
"""A render answer that means the route is not there for us (vLLM without
``--enable-scale-out``: 404; its route without a renderer: 501; behind ``--api-key``, which
guards ``/v1`` but not ``/tokenize``: 401)."""
_EXCERPT_CHARS = 200
_JSON_HEADERS = {"content-type": "application/json"}
_RENDER_PATHS = {False: "/v1/completions/render", True: "/v1/chat/completions/render"}
TokenizeClient = httpx.AsyncClient | Probes
"""What the calls go through: :class:`Probes` (kept-alive, httptools) where the process has
them, else httpx."""


class _TokenizeResponse(msgspec.Struct):
    tokens: list[TokenId]


class _Rendered(msgspec.Struct):
    """One GenerateRequest of a render answer; only its ids are read."""

    token_ids: list[TokenId]


def _excerpt(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _EXCERPT_CHARS else flat[:_EXCERPT_CHARS] + "…"


class ReplicaTokenizer:
    """Tokenizes through one vLLM replica at ``base_url`` by ``route`` (``tokenize`` unless
    told: the read path's tokenizers ask for ``auto``); not thread-safe (one event loop).
    Every failure is a TokenizerError naming the URL asked."""

    def __init__(
        self,
        client: TokenizeClient,
        base_url: str,
        model: str,
        *,
        timeout_s: float = 5.0,
        route: ReplicaRoute = "tokenize",
        reprobe_s: float = RENDER_REPROBE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if route not in get_args(ReplicaRoute):
            raise TokenizerError(f"route must be one of {get_args(ReplicaRoute)}, got {route!r}")
        self.client = client
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/tokenize"
        self.model = model
        self.timeout_s = timeout_s
        self.route = route
        self.reprobe_s = reprobe_s
        self._clock = clock
        self._render_off_until = 0.0
        """Route ``auto``: until then (clock) render is not asked."""

    def uses_render(self) -> bool:
        """Whether the next call asks the render route first."""
        if self.route != "auto":
            return self.route == "render"
        return self._clock() >= self._render_off_until

    async def encode_prompt(self, prompt: str) -> list[int]:
        """Completions tokens (``add_special_tokens`` true); TokenizerError when it fails."""
        body = {"model": self.model, "prompt": prompt, "add_special_tokens": True}
        return await self._encode(body, chat=False)

    async def encode_messages(
        self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS
    ) -> list[int]:
        body = {
            "model": self.model,
            "messages": messages,
            "add_generation_prompt": True,
            "add_special_tokens": False,
            **options.fields(),
        }
        return await self._encode(body, chat=True)

    async def _encode(self, body: dict[str, Any], *, chat: bool) -> list[int]:
        if self.uses_render():
            url = self.base_url + _RENDER_PATHS[chat]
            status, answer = await self._post(url, body)
            if status not in NOT_SERVED or self.route == "render":
                return _rendered_tokens(url, status, answer)
            self._render_off_until = self._clock() + self.reprobe_s
            del answer
        status, answer = await self._post(self.url, body)
        return _tokenize_tokens(self.url, status, answer)

    async def _post(self, url: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """The answer's status and body, not left to httpx (its Response and stream form a
        cycle: the prompt and its tokens would live until the cycle collector ran)."""
        try:
            content = msgspec.json.encode(body)
        except (TypeError, ValueError) as exc:
            raise TokenizerError(f"{url}: request is not JSON-serializable: {exc}") from exc
        if isinstance(self.client, Probes):
            return await self._probed(self.client, url, content)
        headers = {**_JSON_HEADERS, "content-length": str(len(content))}
        request = self.client.build_request(
            "POST", url, content=_sent_once(content), headers=headers, timeout=self.timeout_s
        )
        del content  # the generator holds it until sent
        try:
            response = await self.client.send(request, stream=True)
            try:
                chunks = [chunk async for chunk in response.aiter_bytes()]
            finally:
                await response.aclose()
        except httpx.TimeoutException as exc:
            raise TokenizerError(f"{url}: timed out after {self.timeout_s} s") from exc
        except httpx.RequestError as exc:
            raise TokenizerError(f"{url}: unreachable: {exc!r}") from exc
        return response.status_code, b"".join(chunks)

    async def _probed(self, probes: Probes, url: str, content: bytes) -> tuple[int, bytes]:
        try:
            answer = await probes.post(url, content, timeout=self.timeout_s)
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise TokenizerError(f"{url}: timed out after {self.timeout_s} s") from exc
        except httpx.RequestError as exc:
            raise TokenizerError(f"{url}: unreachable: {exc!r}") from exc
        return answer.status_code, answer.content


def _checked(url: str, status: int, answer: bytes) -> None:
    if status >= 400:
        hint = " (render is served with --enable-scale-out)" if status in NOT_SERVED else ""
        raise TokenizerError(f"{url}: HTTP {status}{hint}: {_excerpt(_text(answer))}")


def _tokenize_tokens(url: str, status: int, answer: bytes) -> list[int]:
    """The ids of a ``/tokenize`` answer (``{"tokens": [...]}``); TokenizerError."""
    _checked(url, status, answer)
    try:
        return msgspec.json.decode(answer, type=_TokenizeResponse).tokens
    except msgspec.DecodeError as exc:
        raise TokenizerError(
            f"{url}: malformed response ({exc}): {_excerpt(_text(answer))}"
        ) from exc


def _rendered_tokens(url: str, status: int, answer: bytes) -> list[int]:
    """The ids of a render answer: chat's one GenerateRequest, completions' list of one (an
    object accepted for either); TokenizerError."""
    _checked(url, status, answer)
    try:
        rendered = msgspec.json.decode(answer, type=_Rendered | list[_Rendered])
    except msgspec.DecodeError as exc:
        raise TokenizerError(
            f"{url}: malformed response ({exc}): {_excerpt(_text(answer))}"
        ) from exc
    if isinstance(rendered, _Rendered):
        return rendered.token_ids
    if len(rendered) != 1:
        raise TokenizerError(f"{url}: expected one rendered prompt, got {len(rendered)}")
    return rendered[0].token_ids


async def _sent_once(content: bytes) -> AsyncIterator[bytes]:
    """``content`` as a body let go of once sent (Content-Length set beside it: not chunked)."""
    yield content


def _text(answer: bytes) -> str:
    return answer.decode("utf-8", "replace")
