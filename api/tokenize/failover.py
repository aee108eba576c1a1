"""The proxy's tokenizers: a model's ``tokenizer.json`` (configured, or in the hub cache),
else its replicas (render route or ``/tokenize``, :mod:`.replica`), those that tokenize as
the reference in turn (:mod:`.renderers`), tried (:data:`MAX_TRIES` at most) until one
answers; each replica keeps what it learnt of its routes while it serves the model."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import Any

from kvindex.api.config.settings import ApiSettings
from kvindex.api.health.routing import ejected_now, health_policy
from kvindex.api.tokenize.cache import CachingTokenizer
from kvindex.api.tokenize.choice import LocalTokenizers, replica_route
from kvindex.api.tokenize.hub_check import HubCheck
from kvindex.api.tokenize.protocol import (
    NO_OPTIONS,
    ChatOptions,
    Tallied,
    Tokenizer,
    TokenizerError,
    as_tallied,
)
from kvindex.api.tokenize.renderers import (
    PROBE_MESSAGES,
    PROBE_PROMPT,
    Ids,
    ProbeAnswer,
    Renderers,
    Replica,
)
from kvindex.api.tokenize.replica import ReplicaRoute, ReplicaTokenizer, TokenizeClient
from kvindex.indexer.fleet.registry import RegistryView

MAX_TRIES = 3


class FailoverTokenizer:
    """One model's tokens from the first of its current replicas that answers, the replicas
    that agree with the reference asked in turn; the error when none does names each replica
    asked and why. :meth:`aclose` stops its vetting."""

    def __init__(
        self,
        model: str,
        registry: RegistryView,
        client: TokenizeClient,
        *,
        timeout_s: float,
        route: ReplicaRoute = "auto",
        ejected: Callable[[], Collection[str]] = frozenset,
        vetting: dict[str, Any] | None = None,
    ) -> None:
        """``ejected``: those out of routing now; ``vetting``: :class:`.Renderers`' options."""
        self._ejected = ejected
        self._model = model
        self._registry = registry
        self._client = client
        self._timeout_s = timeout_s
        self._route = route
        self._url_to_tokenizer: dict[str, ReplicaTokenizer] = {}
        self.renderers = Renderers(model, self._probe, **(vetting or {}))
        self._serving: tuple[int, list[Replica]] | None = None

    async def encode_prompt(self, prompt: str) -> list[int]:
        return await self._first_answer(lambda t: t.encode_prompt(prompt))

    async def encode_messages(
        self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS
    ) -> list[int]:
        return await self._first_answer(lambda t: t.encode_messages(messages, options))

    def serving(self) -> bool:
        """Whether some replica of the model has a URL to tokenize with."""
        return bool(self._replicas())

    async def aclose(self) -> None:
        await self.renderers.aclose()

    def _replicas(self) -> list[Replica]:
        """(id, url) of the model's replicas with a URL: one list while they do not change."""
        version = self._registry.streams_version()
        serving = self._serving
        if serving is None or serving[0] != version:
            replicas = self._registry.replicas()
            found = [(r.id, r.url) for r in replicas if r.model == self._model and r.url]
            if serving is None or serving[1] != found:
                urls = {url for _, url in found}  # the tokenizers of replicas gone are dropped
                kept = self._url_to_tokenizer.items()
                self._url_to_tokenizer = {u: t for u, t in kept if u in urls}
                serving = (version, found)
            serving = self._serving = (version, serving[1])
        return serving[1]

    async def _first_answer(
        self, call: Callable[[ReplicaTokenizer], Awaitable[list[int]]]
    ) -> list[int]:
        replicas = self._replicas()
        if not replicas:
            raise TokenizerError(f"no replica of {self._model!r} has a url to tokenize with")
        errors: list[str] = []
        for replica in self.renderers.order(replicas, MAX_TRIES, self._ejected()):
            try:
                tokens = await call(self._tokenizer(replica[1]))
            except TokenizerError as exc:
                errors.append(f"replica {replica[0]}: {exc}")
                self.renderers.failed(replica)
                continue
            self.renderers.answered(replica)
            return tokens
        if not errors:
            raise TokenizerError(f"every replica of {self._model!r} tokenizes unlike the reference")
        raise TokenizerError("; ".join(errors))

    async def _probe(self, url: str) -> ProbeAnswer:
        tokenizer = self._tokenizer(url)
        prompt = await _ids(tokenizer.encode_prompt(PROBE_PROMPT))
        return prompt, await _ids(tokenizer.encode_messages(PROBE_MESSAGES))

    def _tokenizer(self, url: str) -> ReplicaTokenizer:
        tokenizer = self._url_to_tokenizer.get(url)
        if tokenizer is None:
            tokenizer = ReplicaTokenizer(
                self._client, url, self._model, timeout_s=self._timeout_s, route=self._route
            )
            self._url_to_tokenizer[url] = tokenizer
        return tokenizer


class FleetTokenizers:
    """Every read path's tokenizer of each model: its ``tokenizer.json`` when configured, else
    its replicas in turn; built on first use; the caller owns ``client``."""

    def __init__(
        self, settings: ApiSettings, registry: RegistryView, client: TokenizeClient
    ) -> None:
        self._settings = settings
        self._registry = registry
        self._client = client
        self._local = LocalTokenizers(settings)
        self._hub = HubCheck()
        self._ejected = ejected_now(registry, health_policy(settings))
        self._model_to_tokenizer: dict[str, tuple[Tokenizer, FailoverTokenizer]] = {}

    def tokenizer(self, model: str) -> Tokenizer | None:
        """None: no ``tokenizer.json`` and no replica of the model with a URL."""
        configured = self._settings.model(model)
        setting = None if configured is None else configured.tokenizer
        route = replica_route(setting)
        if route is None:  # a path
            return self._local.tokenizer(model)
        replicas, failover = self._replicas(model, route)
        serving = failover.serving()
        if setting is None:  # unset: the hub cache's, when there and not found to differ
            local = self._local.tokenizer(model)
            if local is not None and (not serving or self._hub.trusted(model, local, replicas)):
                return local
        return replicas if serving else None

    def forget(self, model: str) -> None:
        self._local.forget(model)
        self._hub.forget(model)

    def hub_verdicts(self) -> dict[str, str]:
        return self._hub.verdicts()

    def locals(self) -> list[tuple[str, Tallied]]:
        """Each model's tokenizer in process that counts what it did (for its metrics)."""
        built = [(model, as_tallied(tokenizer)) for model, tokenizer in self._local.built()]
        return [(model, tallied) for model, tallied in built if tallied is not None]

    def renderers(self) -> list[Renderers]:
        """Each replica-tokenized model's :class:`.Renderers` (for its metrics)."""
        return [failover.renderers for _, failover in self._model_to_tokenizer.values()]

    async def aclose(self) -> None:
        await self._hub.aclose()
        for _, failover in self._model_to_tokenizer.values():
            await failover.aclose()

    def _replicas(self, model: str, route: ReplicaRoute) -> tuple[Tokenizer, FailoverTokenizer]:
        kept = self._model_to_tokenizer.get(model)
        if kept is None:
            kept = self._model_to_tokenizer[model] = self._failover(model, route)
        return kept

    def _failover(self, model: str, route: ReplicaRoute) -> tuple[Tokenizer, FailoverTokenizer]:
        settings = self._settings
        inner = FailoverTokenizer(
            model,
            self._registry,
            self._client,
            timeout_s=settings.scrape_timeout_s,
            route=route,
            ejected=self._ejected,
        )
        if settings.tokenizer_cache_entries == 0:
            return inner, inner
        entries, size = settings.tokenizer_cache_entries, settings.tokenizer_cache_bytes
        return CachingTokenizer(inner, entries, size), inner


async def _ids(call: Awaitable[list[int]]) -> Ids | None:
    try:
        return tuple(await call)
    except TokenizerError:
        return None
