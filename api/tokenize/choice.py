"""Which tokenizer a model gets: the configured ``tokenizer.json``, else a healthy replica's
render route or ``/tokenize`` (:mod:`.replica`), else none; a bad spec is a TokenizerError
naming the field."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from kvindex.api.config.settings import ApiSettings
from kvindex.api.health.routing import health_policy
from kvindex.api.tokenize.cache import DEFAULT_MAX_BYTES, CachingTokenizer
from kvindex.api.tokenize.protocol import Tokenizer, TokenizerError
from kvindex.api.tokenize.replica import ReplicaRoute, ReplicaTokenizer, TokenizeClient
from kvindex.indexer.fleet.registry import RegistryView

TokenizerKind = Literal["local", "replica"]
REPLICA_ROUTES: dict[str, ReplicaRoute] = {
    "replica": "auto",
    "render": "render",
    "tokenize": "tokenize",
}
"""``[[models]] tokenizer`` values that name a replica route; any other value is a path."""


def replica_route(tokenizer: str | None) -> ReplicaRoute | None:
    """The replica route a model's ``tokenizer`` setting names (unset: ``auto``); None when it
    is a ``tokenizer.json`` path."""
    return "auto" if tokenizer is None else REPLICA_ROUTES.get(tokenizer)


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """How to tokenize one model's requests: ``local`` sets ``path`` (and a chat template:
    default beside it), ``replica`` sets ``base_url``, ``model`` and ``route``; 0 entries: no
    cache (else at most ``cache_entries`` and ``cache_bytes``, :class:`.CachingTokenizer`); a
    local one reuses shared prefixes in ``prefix_cache_bytes`` (0: none)."""

    kind: TokenizerKind
    path: str | None = None
    chat_template_path: str | None = None
    base_url: str | None = None
    model: str | None = None
    timeout_s: float = 5.0
    cache_entries: int = 4096
    cache_bytes: int = DEFAULT_MAX_BYTES
    prefix_cache_bytes: int = DEFAULT_MAX_BYTES
    route: ReplicaRoute = "auto"

    def __post_init__(self) -> None:
        if self.kind not in get_args(TokenizerKind):
            raise TokenizerError(
                f"kind must be one of {get_args(TokenizerKind)}, got {self.kind!r}"
            )
        if self.cache_entries < 0:
            raise TokenizerError(f"cache_entries must be >= 0, got {self.cache_entries!r}")
        if self.cache_bytes < 1:
            raise TokenizerError(f"cache_bytes must be >= 1, got {self.cache_bytes!r}")
        if self.prefix_cache_bytes < 0:
            raise TokenizerError(
                f"prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes!r}"
            )
        if self.kind == "local":
            self._check_local()
        else:
            self._check_replica()

    def _check_local(self) -> None:
        if not self.path:
            raise TokenizerError("path is required when kind is 'local'")
        _forbid(self, ("base_url", "model"), "local")

    def _check_replica(self) -> None:
        if not self.base_url or not self.base_url.startswith(("http://", "https://")):
            raise TokenizerError(f"base_url must be an http(s):// URL, got {self.base_url!r}")
        if not self.model:
            raise TokenizerError("model is required when kind is 'replica'")
        if not self.timeout_s > 0:
            raise TokenizerError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.route not in get_args(ReplicaRoute):
            raise TokenizerError(
                f"route must be one of {get_args(ReplicaRoute)}, got {self.route!r}"
            )
        _forbid(self, ("path", "chat_template_path"), "replica")


def _forbid(spec: TokenizerSpec, names: tuple[str, ...], kind: str) -> None:
    for name in names:
        if getattr(spec, name) is not None:
            raise TokenizerError(f"{name} is not used when kind is {kind!r}; remove it")


def build_tokenizer(spec: TokenizerSpec, client: TokenizeClient) -> Tokenizer:
    inner: Tokenizer
    if spec.kind == "local":
        assert spec.path is not None  # checked by TokenizerSpec
        # Imported here: `tokenizers` and `jinja2` cost an API that has no local tokenizer
        # (most of them) memory.
        from kvindex.api.tokenize.local import LocalTokenizer  # noqa: PLC0415

        inner = LocalTokenizer.from_files(
            spec.path, spec.chat_template_path, prefix_cache_bytes=spec.prefix_cache_bytes
        )
    else:
        assert spec.base_url is not None and spec.model is not None  # checked by TokenizerSpec
        inner = ReplicaTokenizer(
            client, spec.base_url, spec.model, timeout_s=spec.timeout_s, route=spec.route
        )
    if spec.cache_entries == 0:
        return inner
    return CachingTokenizer(inner, spec.cache_entries, spec.cache_bytes)


_RECHECK_S = 1.0


class ModelTokenizers:
    """The tokenizer of each model, built on first use, another replica's once its is ejected."""

    def __init__(
        self,
        settings: ApiSettings,
        registry: RegistryView,
        client: TokenizeClient,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._settings = settings
        self._registry = registry
        self._client = client
        self._model_to_tokenizer: dict[str, tuple[str | None, Tokenizer | None]] = {}
        """Per model: the replica its tokenizer asks (None: none asked), the tokenizer."""
        self._recheck_at: dict[str, float] = {}
        self._policy = health_policy(settings)

    def tokenizer(self, model: str) -> Tokenizer | None:
        kept = self._model_to_tokenizer.get(model)
        if kept is not None and (kept[0] is None or self._clock() < self._recheck_at[model]):
            return kept[1]
        self._recheck_at[model] = self._clock() + _RECHECK_S
        ejected = self._ejected()
        if kept is not None and kept[0] not in ejected:
            return kept[1]
        replica = self._replica_asked(model, ejected)
        # Every replica ejected: keep the one asked (another would be no better).
        if kept is None or (replica != kept[0] and replica not in ejected):
            kept = self._model_to_tokenizer[model] = (replica, self._build(model))
        return kept[1]

    async def aclose(self) -> None:
        """Nothing of it runs in the background: nothing to stop."""

    def forget(self, model: str) -> None:
        """Choose the model's tokenizer again at its next request."""
        self._model_to_tokenizer.pop(model, None)
        self._recheck_at.pop(model, None)

    def _ejected(self) -> set[str]:
        now = self._clock()
        health = self._registry.replica_health()
        return {r for r, h in health.items() if h.ejection(now, self._policy) is not None}

    def _replica_asked(self, model: str, ejected: set[str]) -> str | None:
        configured = self._settings.model(model)
        if configured is not None and replica_route(configured.tokenizer) is None:
            return None
        serving = [r.id for r in self._registry.replicas() if r.model == model and r.url]
        healthy = [r for r in serving if r not in ejected]
        return next(iter(healthy or serving), None)

    def spec(self, model: str) -> TokenizerSpec | None:
        """The spec picked for ``model`` now (None: nothing to tokenize with)."""
        settings = self._settings
        configured = settings.model(model)
        entries, size = settings.tokenizer_cache_entries, settings.tokenizer_cache_bytes
        route = replica_route(None if configured is None else configured.tokenizer)
        if route is None:
            assert configured is not None and configured.tokenizer is not None
            path = configured.tokenizer
            prefix = settings.tokenizer_prefix_cache_bytes
            return TokenizerSpec(
                "local", path, cache_entries=entries, cache_bytes=size, prefix_cache_bytes=prefix
            )
        replica = self._replica_asked(model, self._ejected())
        spec = None if replica is None else self._registry.get(replica)
        if spec is None or spec.url is None:
            return None
        return TokenizerSpec(
            kind="replica",
            base_url=spec.url,
            model=model,
            timeout_s=settings.scrape_timeout_s,
            cache_entries=entries,
            cache_bytes=size,
            route=route,
        )

    def _build(self, model: str) -> Tokenizer | None:
        spec = self.spec(model)
        return None if spec is None else build_tokenizer(spec, self._client)
