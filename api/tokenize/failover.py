"""The proxy's tokenizers: a model's configured ``tokenizer.json``, else its replicas (render
route or ``/tokenize``, :mod:`.replica`) tried in turn (:data:`MAX_TRIES` at most) until one
answers; each replica keeps what it learnt of its routes while it serves the model."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from kvindex.api.config.settings import ApiSettings
from kvindex.api.tokenize.cache import CachingTokenizer
from kvindex.api.tokenize.choice import ModelTokenizers, replica_route
from kvindex.api.tokenize.protocol import NO_OPTIONS, ChatOptions, Tokenizer, TokenizerError
from kvindex.api.tokenize.replica import ReplicaRoute, ReplicaTokenizer, TokenizeClient
from kvindex.indexer.fleet.registry import RegistryView

MAX_TRIES = 3


class FailoverTokenizer:
    """One model's tokens from the first of its current replicas that answers; the error when
    none does names each replica asked and why."""

    def __init__(
        self,
        model: str,
        registry: RegistryView,
        client: TokenizeClient,
        *,
        timeout_s: float,
        route: ReplicaRoute = "auto",
    ) -> None:
        self._model = model
        self._registry = registry
        self._client = client
        self._timeout_s = timeout_s
        self._route = route
        self._url_to_tokenizer: dict[str, ReplicaTokenizer] = {}
        self._last_good: str | None = None

    async def encode_prompt(self, prompt: str) -> list[int]:
        return await self._first_answer(lambda t: t.encode_prompt(prompt))

    async def encode_messages(
        self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS
    ) -> list[int]:
        return await self._first_answer(lambda t: t.encode_messages(messages, options))

    def urls(self) -> list[str]:
        """The replicas to ask, in order: the last one that answered first."""
        return [url for _, url in self._replicas()]

    def _replicas(self) -> list[tuple[str, str]]:
        """(id, url) of the replicas to ask, in order: the last one that answered first."""
        serving = [(r.id, r.url) for r in self._registry.replicas() if r.model == self._model]
        found = [(replica, url) for replica, url in serving if url]
        return sorted(found, key=lambda pair: pair[1] != self._last_good)  # a stable sort

    async def _first_answer(
        self, call: Callable[[ReplicaTokenizer], Awaitable[list[int]]]
    ) -> list[int]:
        replicas = self._replicas()
        if not replicas:
            raise TokenizerError(f"no replica of {self._model!r} has a url to tokenize with")
        errors: list[str] = []
        for replica, url in replicas[:MAX_TRIES]:
            try:
                tokens = await call(self._tokenizer(url))
            except TokenizerError as exc:
                errors.append(f"replica {replica}: {exc}")
                continue
            self._last_good = url
            return tokens
        raise TokenizerError("; ".join(errors))

    def _tokenizer(self, url: str) -> ReplicaTokenizer:
        tokenizer = self._url_to_tokenizer.get(url)
        if tokenizer is None:
            tokenizer = ReplicaTokenizer(
                self._client, url, self._model, timeout_s=self._timeout_s, route=self._route
            )
            self._url_to_tokenizer[url] = tokenizer
        return tokenizer


class ProxyTokenizers:
    """The tokenizer of each model, built on first use; the caller owns ``client``."""

    def __init__(
        self, settings: ApiSettings, registry: RegistryView, client: TokenizeClient
    ) -> None:
        self._settings = settings
        self._registry = registry
        self._client = client
        self._local = ModelTokenizers(settings, registry, client)
        self._model_to_tokenizer: dict[str, Tokenizer] = {}

    def tokenizer(self, model: str) -> Tokenizer | None:
        configured = self._settings.model(model)
        route = replica_route(None if configured is None else configured.tokenizer)
        if route is None:
            return self._local.tokenizer(model)
        tokenizer = self._model_to_tokenizer.get(model)
        if tokenizer is None:
            tokenizer = self._failover(model, route)
            self._model_to_tokenizer[model] = tokenizer
        return tokenizer

    def forget(self, model: str) -> None:
        self._local.forget(model)

    def _failover(self, model: str, route: ReplicaRoute) -> Tokenizer:
        settings = self._settings
        inner = FailoverTokenizer(
            model, self._registry, self._client, timeout_s=settings.scrape_timeout_s, route=route
        )
        if settings.tokenizer_cache_entries == 0:
            return inner
        return CachingTokenizer(
            inner, settings.tokenizer_cache_entries, settings.tokenizer_cache_bytes
        )
