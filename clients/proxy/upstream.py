"""The upstream choice: which replicas a request should go to, best first, as ``/score``
ranks them (the unhealthy left out while one is healthy); used on the scorer's event loop."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from kvindex.api.health.routing import ejected_at
from kvindex.api.reasons import Explains
from kvindex.api.schemas import ScoreRequest
from kvindex.api.score import Ranking, Scorer, UnknownModelError
from kvindex.api.tokenize.protocol import NO_OPTIONS, TokenizerError, chat_options_of
from kvindex.clients.proxy.predictions import Prediction
from kvindex.clients.proxy.untokenized import FailureLog
from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.fleet.registry import RegistryView
from kvindex.indexer.fleet.replica_health import HealthPolicy

logger = logging.getLogger("kvindex.proxy")
SESSION_HEADER = "x-kvindex-session"
MAX_DEPTH = 64
"""Deepest nesting of arrays and objects a JSON body may have (OpenAI's bodies: under 20)."""


class NoUpstreamError(KvIndexError):
    """The model is known but no replica of it has a URL to forward to (503)."""


class BadRequestBodyError(KvIndexError):
    """A body that is not a JSON object with a string ``model``, or nests too deep (400)."""


def decoded_body(body: bytes) -> Any:
    """``body`` decoded, nested at most :data:`MAX_DEPTH` deep (nothing after recurses further);
    msgspec.DecodeError when it is not JSON, BadRequestBodyError when it nests deeper."""
    try:
        decoded = msgspec.json.decode(body)
    except RecursionError:  # msgspec's own recursion guard, far deeper than MAX_DEPTH
        raise BadRequestBodyError(f"the body nests deeper than {MAX_DEPTH} levels") from None
    if _deeper_than(decoded, MAX_DEPTH):
        raise BadRequestBodyError(f"the body nests deeper than {MAX_DEPTH} levels")
    return decoded


def _deeper_than(value: Any, limit: int) -> bool:
    """An array or object nested more than ``limit`` deep in ``value`` (decoded JSON: plain
    dicts and lists), one level at a time."""
    level = [value] if type(value) is dict or type(value) is list else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        deeper = []
        for node in level:
            for child in node.values() if type(node) is dict else node:
                if type(child) is dict or type(child) is list:
                    deeper.append(child)
        level = deeper
    return False


@dataclass(frozen=True, slots=True)
class Upstream:
    replica: str
    url: str
    num_uncached_tokens: int = 0
    """The prompt's tokens it does not hold cached (0: the prompt was not tokenized)."""
    num_matched_tokens: int = 0
    """The prompt's tokens the index says it holds cached (its matched blocks)."""


@dataclass(frozen=True, slots=True)
class Choice:
    """Where one request goes: ``upstreams`` best first (the next ones are the retries)."""

    upstreams: tuple[Upstream, ...]
    matched_fraction: float | None
    """The best replica's cached share of the prompt (None: the prompt was not tokenized)."""
    model: str = ""
    num_tokens: int = 0
    """The router's count of the prompt's tokens (0: not tokenized, no prediction)."""
    block_size: int = 0
    untokenized: bool = False
    """The prompt's tokenizer failed: ranked on load alone (the answer says so)."""
    reasons: Explains | None = None
    """What explains the best upstreams (the picker's ``explain``: what a receipt shows),
    worded when read (:meth:`~kvindex.api.reasons.Reasons.answer`)."""
    rest: Callable[[], Coroutine[Any, Any, bytes]] | None = None
    """Chosen on the prompt's head (``head_first``): its whole tokenization, owed once the
    choice is sent (``num_tokens`` is estimated meanwhile)."""

    def prediction(self, upstream: Upstream) -> Prediction | None:
        """What the index predicted of ``upstream`` (None: the prompt was not tokenized)."""
        if not self.num_tokens or not self.block_size:
            return None
        return Prediction(
            upstream.replica,
            self.model,
            self.num_tokens,
            upstream.num_matched_tokens,
            self.block_size,
        )


class UpstreamPicker:
    def __init__(
        self,
        scorer: Scorer,
        registry: RegistryView,
        *,
        on_tokenize_failure: Any = lambda _model: None,
        lora_base: Callable[[str], str | None] = lambda _name: None,
        health_policy: HealthPolicy | None = None,
        explain: int = 0,
        head_first: bool = False,
    ) -> None:
        """``explain`` > 0: each choice carries the reasons of at most that many best
        candidates (the upstreams are as many: no retry is lost), worded when read;
        ``head_first``: see :meth:`~kvindex.api.score.Scorer.ranking`."""
        self._scorer = scorer
        self._explain = explain
        self._head_first = head_first
        self._health_policy = health_policy or HealthPolicy()
        self._registry = registry
        self._on_tokenize_failure = on_tokenize_failure
        self._failure_log = FailureLog(logger)
        self._lora_base = lora_base
        self._turn = 0

    async def choose(self, body: Mapping[str, Any], headers: Mapping[str, str]) -> Choice:
        """The replicas to try for ``body``; raises UnknownModelError (404), NoUpstreamError
        (503) or the scorer's RequestError (422)."""
        model = body.get("model")
        if not isinstance(model, str):
            raise BadRequestBodyError("model: a string is required")
        base = self._lora_base(model)
        served = model if base is None else base
        urls: dict[str, str] = {}
        all_have_urls = True
        for r in self._registry.replicas():
            if r.model == served:
                if r.url:
                    urls[r.id] = r.url
                else:
                    all_have_urls = False
        if not urls:
            if served not in self._scorer.known_models():
                raise UnknownModelError(
                    f"unknown model {model!r}; known models: {self._scorer.known_models()}"
                )
            raise NoUpstreamError(f"no replica of {served!r} has a url to forward to")
        lora_name = None if base is None else model
        # Every replica of the model: the scorer's own list of them (the same, made once).
        cands = None if all_have_urls else list(urls)
        answer, untokenized = await self._score(served, lora_name, body, headers, cands)
        num_tokens = answer.num_tokens
        upstreams = tuple(
            Upstream(replica, urls[replica], max(0, num_tokens - matched), matched)
            for replica, matched in answer.ranked
            if replica in urls
        )
        block_size = self._scorer.block_size(served)
        fraction = _matched_fraction(answer)
        reasons, rest = answer.reasons, answer.rest
        return Choice(
            upstreams, fraction, served, num_tokens, block_size, untokenized, reasons, rest
        )

    def choose_any(self) -> Choice:
        """Every replica with a ``url`` but the ejected (all if all are), one further each call."""
        upstreams = [Upstream(r.id, r.url) for r in self._registry.replicas() if r.url]
        if not upstreams:
            raise NoUpstreamError("no replica has a url to forward to")
        ejected = ejected_at(self._registry, time.time(), self._health_policy)
        upstreams = [u for u in upstreams if u.replica not in ejected] or upstreams
        start = self._turn % len(upstreams)
        self._turn += 1
        return Choice(tuple(upstreams[start:] + upstreams[:start]), None)

    async def _score(
        self,
        model: str,
        lora_name: str | None,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        cands: list[str] | None,
    ) -> tuple[Ranking, bool]:
        """The ranking (reasons if explained), and whether made without the prompt's tokens."""
        session = headers.get(SESSION_HEADER) or _string(body.get("user"))
        common: dict[str, Any] = {
            "model": model,
            "candidates": cands,
            "session": session,
            "lora_name": lora_name,
            "cache_salt": _string(body.get("cache_salt")),
            # What [[rules]] may match besides the headers (the workload header included).
            "user": _string(body.get("user")),
            "has_tools": bool(body.get("tools") or body.get("functions")),
        }
        try:
            request = ScoreRequest(**common, **_prompt_of(body))
            explain, head_first = self._explain, self._head_first
            ranking = await self._scorer.ranking(
                request, headers, explain=explain, head_first=head_first
            )
            return ranking, False
        except TokenizerError as exc:
            self._failure_log.failed(model, str(exc))
            self._on_tokenize_failure(model)
        request = ScoreRequest(**common, block_keys=[])
        return await self._scorer.ranking(request, headers, explain=self._explain), True


def _prompt_of(body: Mapping[str, Any]) -> dict[str, Any]:
    """The ScoreRequest field carrying the body's prompt (none: ranked on load alone)."""
    messages = body.get("messages")
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
        options = chat_options_of(body)
        return (
            {"messages": messages}
            if options is NO_OPTIONS
            else {"messages": messages, **options.fields()}
        )
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


def _matched_fraction(answer: Ranking) -> float | None:
    if not answer.num_tokens or not answer.ranked:
        return None
    return min(1.0, answer.ranked[0][1] / answer.num_tokens)
