"""The upstream choice: which replicas a request should go to, best first.

An OpenAI body becomes a :class:`~kvindex.api.schemas.ScoreRequest` (the whole ``messages``
of a chat, or the ``prompt`` of a completion; ``cache_salt`` from the body; the session from
``x-kvindex-session`` or the ``user`` field) and is answered by the same
:class:`~kvindex.api.score.Scorer` as ``/score`` (tokenizer, index, load, policy and
weights per model). The candidates are the model's replicas that have a ``url``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvindex.api.schemas import ScoreRequest, ScoreResponse
from kvindex.api.score import Scorer, UnknownModelError
from kvindex.api.tokenize.protocol import TokenizerError
from kvindex.indexer.errors import KvIndexError
from kvindex.indexer.fleet.registry import RegistryView

logger = logging.getLogger("kvindex.proxy")
SESSION_HEADER = "x-kvindex-session"
"""Request header naming a session (for the ``session_affinity`` policy)."""


class NoUpstreamError(KvIndexError):
    """The model is known but no replica of it has a URL to forward to (503)."""


class BadRequestBodyError(KvIndexError):
    """A body that is not a JSON object with a string ``model`` (400)."""


@dataclass(frozen=True, slots=True)
class Upstream:
    """One replica requests can go to."""

    replica: str
    url: str
    """Its HTTP root, ``http://host:port`` (the request path is appended)."""


@dataclass(frozen=True, slots=True)
class Choice:
    """Where one request goes: ``upstreams`` best first (the next ones are the retries)."""

    upstreams: tuple[Upstream, ...]
    matched_fraction: float | None
    """The best replica's cached share of the prompt (None: the prompt was not tokenized)."""


class UpstreamPicker:
    """Turns a request body into a :class:`Choice`; use from the scorer's event loop.

    ``on_tokenize_failure(model)`` is told when a prompt could not be tokenized (the
    replica asked is down, say): the request is then ranked on load alone, never refused.
    """

    def __init__(
        self,
        scorer: Scorer,
        registry: RegistryView,
        *,
        on_tokenize_failure: Any = lambda _model: None,
    ) -> None:
        self._scorer = scorer
        self._registry = registry
        self._on_tokenize_failure = on_tokenize_failure

    async def choose(self, body: Mapping[str, Any], headers: Mapping[str, str]) -> Choice:
        """The replicas to try for ``body``; raises UnknownModelError (404), NoUpstreamError
        (503) or the scorer's RequestError (422)."""
        model = body.get("model")
        if not isinstance(model, str):
            raise BadRequestBodyError("model: a string is required")
        urls = {r.id: r.url for r in self._registry.replicas() if r.model == model and r.url}
        if not urls:
            if model not in self._scorer.known_models():
                raise UnknownModelError(
                    f"unknown model {model!r}; known models: {self._scorer.known_models()}"
                )
            raise NoUpstreamError(f"no replica of {model!r} has a url to forward to")
        answer = await self._score(model, body, headers, list(urls))
        order = [e.replica for e in answer.scores if e.replica in urls]
        upstreams = tuple(Upstream(r, urls[r]) for r in order)
        return Choice(upstreams, _matched_fraction(answer))

    async def _score(
        self, model: str, body: Mapping[str, Any], headers: Mapping[str, str], cands: list[str]
    ) -> ScoreResponse:
        session = headers.get(SESSION_HEADER) or _string(body.get("user"))
        common: dict[str, Any] = {
            "model": model,
            "candidates": cands,
            "session": session,
            "cache_salt": _string(body.get("cache_salt")),
        }
        try:
            return await self._scorer.score(ScoreRequest(**common, **_prompt_of(body)))
        except TokenizerError as exc:
            logger.warning("routing %s on load alone: %s", model, exc)
            self._on_tokenize_failure(model)
        return await self._scorer.score(ScoreRequest(**common, block_keys=[]))


def _prompt_of(body: Mapping[str, Any]) -> dict[str, Any]:
    """The ScoreRequest field that carries the body's prompt; none known: no keys (the
    request is ranked on load alone)."""
    messages = body.get("messages")
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
        return {"messages": messages}
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        return {"token_ids": prompt}
    return {"block_keys": []}


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def _string(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _matched_fraction(answer: ScoreResponse) -> float | None:
    if not answer.num_tokens or not answer.scores:
        return None
    return min(1.0, answer.scores[0].matched_tokens / answer.num_tokens)
