"""The choice behind a pick: the proxy's :class:`UpstreamPicker` on an OpenAI body, endpoints
best first inside the gateway's subset; one that cannot be served is a :class:`RefusalError`."""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, cast

import msgspec

from kvindex.api.health.routing import ejected_at
from kvindex.api.score import RequestError, UnknownModelError
from kvindex.clients.picker.endpoints import EndpointBook
from kvindex.clients.proxy.upstream import (
    BadRequestBodyError,
    Choice,
    NoUpstreamError,
    UpstreamPicker,
    decoded_body,
)
from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.fleet.registry import RegistryView
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.fleet.replica_health import HealthPolicy


class RefusalError(KvIndexError):
    """No endpoint named: the gateway answers ``status`` itself (an ImmediateResponse)."""

    def __init__(self, status: int, outcome: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.outcome = outcome
        """The ``outcome`` label of the decisions metric."""


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes: ``endpoints`` best first (the rest are the gateway's fallbacks)."""

    endpoints: tuple[str, ...]
    replicas: tuple[str, ...]
    num_uncached_tokens: int
    """The prompt's tokens the primary does not hold cached (0: not tokenized)."""
    rest: Callable[[], Coroutine[Any, Any, bytes]] | None = None
    """Chosen on the prompt's head: its whole tokenization, owed once the answer is sent."""


class _SubsetView:
    """The registry with only the subset's replicas listed (what the picker scores among)."""

    def __init__(self, registry: RegistryView, replicas: frozenset[str]) -> None:
        self._registry = registry
        self._replicas = replicas

    def replicas(self) -> list[ReplicaSpec]:
        return [r for r in self._registry.replicas() if r.id in self._replicas]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._registry, name)


class EndpointChooser:
    """Chooses on the scorer's event loop; ``num_endpoints`` named at most per decision;
    ``upstreams_over`` makes the proxy's chooser over a registry (the subset's view)."""

    def __init__(
        self,
        upstreams_over: Callable[[RegistryView], UpstreamPicker],
        registry: RegistryView,
        *,
        num_endpoints: int,
        health_policy: HealthPolicy,
    ) -> None:
        self._upstreams_over = upstreams_over
        self._upstreams = upstreams_over(registry)
        self._registry = registry
        self._num_endpoints = num_endpoints
        self._health_policy = health_policy
        self._book = EndpointBook()

    async def choose(
        self, body: bytes, headers: Mapping[str, str], subset: frozenset[str] | None
    ) -> Decision:
        """The endpoints for an OpenAI ``body`` (empty: every endpoint, one further each
        call); RefusalError: 400 (not such a body), 404 (unknown model), 503 (no endpoint, or
        none in ``subset``)."""
        book = self._book.update(self._registry.replicas())
        upstreams = self._upstreams
        inside: frozenset[str] | None = None
        if subset is not None:
            inside = frozenset(r for r, e in book.replica_to_endpoint.items() if e in subset)
            if not inside:
                raise RefusalError(503, "subset_miss", "no endpoint of the subset hint serves")
        if body and inside is not None:
            view = cast("RegistryView", _SubsetView(self._registry, inside))
            upstreams = self._upstreams_over(view)
        try:
            if body:
                choice = await upstreams.choose(_decoded(body), headers)
            else:
                choice = upstreams.choose_any()
        except UnknownModelError as exc:
            raise RefusalError(404, "unknown_model", str(exc)) from None
        except NoUpstreamError as exc:
            outcome = "no_endpoint" if subset is None else "subset_miss"
            raise RefusalError(503, outcome, str(exc)) from None
        except (BadRequestBodyError, RequestError) as exc:
            raise RefusalError(400, "bad_request", str(exc)) from None
        return self._decision(choice, book, inside)

    def _decision(
        self, choice: Choice, book: EndpointBook, inside: frozenset[str] | None
    ) -> Decision:
        ejected = self._ejected()
        named = [
            (u, book.replica_to_endpoint[u.replica])
            for u in choice.upstreams
            if u.replica not in ejected
            and u.replica in book.replica_to_endpoint
            and (inside is None or u.replica in inside)
        ][: self._num_endpoints]
        if not named:
            raise RefusalError(503, "no_endpoint", "no endpoint is routable (every one ejected)")
        return Decision(
            tuple(e for _, e in named),
            tuple(u.replica for u, _ in named),
            named[0][0].num_uncached_tokens,
            choice.rest,
        )

    def _ejected(self) -> frozenset[str]:
        return ejected_at(self._registry, time.time(), self._health_policy)


def _decoded(body: bytes) -> Mapping[str, Any]:
    try:
        decoded = decoded_body(body)
    except (msgspec.DecodeError, BadRequestBodyError) as exc:
        raise RefusalError(400, "bad_request", f"the body is not JSON: {exc}") from None
    if not isinstance(decoded, dict):
        raise RefusalError(400, "bad_request", "the body is not a JSON object")
    return decoded
