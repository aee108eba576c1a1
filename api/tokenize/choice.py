"""A model's ``tokenizer`` setting: a replica route (:mod:`.failover` asks them) or a
``tokenizer.json`` built here (unset: the hub cache's, :mod:`.hf_cache`); a bad spec is a
TokenizerError naming the field."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvindex.api.config.settings import ApiSettings
from kvindex.api.tokenize.cache import DEFAULT_MAX_BYTES, CachingTokenizer
from kvindex.api.tokenize.hf_cache import cached_tokenizer, hub_dir
from kvindex.api.tokenize.protocol import Tokenizer, TokenizerError
from kvindex.api.tokenize.replica import ReplicaRoute

REPLICA_ROUTES: dict[str, ReplicaRoute] = {
    "replica": "auto",
    "render": "render",
    "tokenize": "tokenize",
}
"""``[[models]] tokenizer`` values that name a replica route; any other value is a path."""
logger = logging.getLogger(__name__)
# Models whose resolved spec is remembered (a store outage lets unknown names through).
MAX_LOOKUPS_KEPT = 1024


def replica_route(tokenizer: str | None) -> ReplicaRoute | None:
    """The replica route a model's ``tokenizer`` setting names (unset: ``auto``); None when it
    is a ``tokenizer.json`` path."""
    return "auto" if tokenizer is None else REPLICA_ROUTES.get(tokenizer)


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """A ``tokenizer.json`` (its chat template beside it by default); 0 ``cache_entries``: no
    :class:`.CachingTokenizer`; 0 ``prefix_cache_bytes``: no prefix reuse."""

    path: str
    chat_template_path: str | None = None
    cache_entries: int = 4096
    cache_bytes: int = DEFAULT_MAX_BYTES
    prefix_cache_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        if not self.path:
            raise TokenizerError("path is required: the model's tokenizer.json")
        if self.cache_entries < 0:
            raise TokenizerError(f"cache_entries must be >= 0, got {self.cache_entries!r}")
        if self.cache_bytes < 1:
            raise TokenizerError(f"cache_bytes must be >= 1, got {self.cache_bytes!r}")
        if self.prefix_cache_bytes < 0:
            raise TokenizerError(
                f"prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes!r}"
            )


def build_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    # Imported here: `tokenizers` and `jinja2` cost an API that has no local tokenizer (most
    # of them) memory.
    from kvindex.api.tokenize.local import LocalTokenizer  # noqa: PLC0415

    inner = LocalTokenizer.from_files(
        spec.path, spec.chat_template_path, prefix_cache_bytes=spec.prefix_cache_bytes
    )
    if spec.cache_entries == 0:
        return inner
    return CachingTokenizer(inner, spec.cache_entries, spec.cache_bytes)


class LocalTokenizers:
    """Each model's ``tokenizer.json``, configured or found in the hub cache, built on first
    use (a failed build of a configured one tried again; of a found one: not used)."""

    def __init__(self, settings: ApiSettings) -> None:
        self._settings = settings
        self._model_to_tokenizer: dict[str, Tokenizer] = {}
        self._hub = hub_dir(settings.hf_hub_cache)
        self._specs: dict[str, TokenizerSpec | None] = {}  # each model's, resolved once
        self._found: dict[str, str | None] = {}  # the hub cache's file of a model naming none

    def tokenizer(self, model: str) -> Tokenizer | None:
        """None: none configured or found; TokenizerError: the configured one is unreadable."""
        kept = self._model_to_tokenizer.get(model)
        if kept is not None:
            return kept
        spec = self.spec(model)
        if spec is None:
            return None
        try:
            built = build_tokenizer(spec)
        except TokenizerError as exc:
            if self._found.get(model) is None:
                raise
            logger.warning("%s: the hub cache's %s is not used: %s", model, spec.path, exc)
            self._found[model] = self._specs[model] = None
            return None
        self._model_to_tokenizer[model] = built
        return built

    def built(self) -> list[tuple[str, Tokenizer]]:
        """Each model's tokenizer built so far."""
        return list(self._model_to_tokenizer.items())

    def forget(self, model: str) -> None:
        """Build the model's tokenizer again at its next request (and look it up again)."""
        self._model_to_tokenizer.pop(model, None)
        self._specs.pop(model, None)
        self._found.pop(model, None)

    def spec(self, model: str) -> TokenizerSpec | None:
        """The spec of ``model``'s ``tokenizer.json`` (None: a replica route, or none found)."""
        specs = self._specs
        if model in specs:
            return specs[model]
        if len(specs) >= MAX_LOOKUPS_KEPT:  # names a request made up: resolved again
            specs.clear()
            self._found.clear()
        spec = specs[model] = self._resolved(model)
        return spec

    def _resolved(self, model: str) -> TokenizerSpec | None:
        settings = self._settings
        configured = settings.model(model)
        path = None if configured is None else configured.tokenizer
        if path is None:
            path = self._in_hub(model)
        if path is None or replica_route(path) is not None:
            return None
        return TokenizerSpec(
            path,
            cache_entries=settings.tokenizer_cache_entries,
            cache_bytes=settings.tokenizer_cache_bytes,
            prefix_cache_bytes=settings.tokenizer_prefix_cache_bytes,
        )

    def _in_hub(self, model: str) -> str | None:
        found = None if self._hub is None else cached_tokenizer(model, self._hub)
        path = self._found[model] = None if found is None else str(found)
        if path is not None:
            logger.info("%s: tokenized by %s (the Hugging Face hub cache)", model, path)
        return path
