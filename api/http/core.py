"""What the API answers without its web framework: ``POST /score``, ``GET /healthz`` and
``GET /readyz`` as hot routes, the bearer check, the one error → HTTP mapping and the
metrics. FastAPI's routes (:mod:`kvindex.api.http.app`) call the same answers; a served
process answers the hot routes before FastAPI is even imported."""

from __future__ import annotations

import secrets
import time
from typing import Any

import msgspec
from starlette.datastructures import Headers
from starlette.responses import Response

from kvindex.api.config.url_policy import UntrustedUrlError
from kvindex.api.http.body_limit import BodyTimeoutError, BodyTooLargeError
from kvindex.api.http.hot_routes import Answer, HotRoute, HotServing, RouteName
from kvindex.api.http.metrics import ApiMetrics, TimedIndex, TokenizerCollector
from kvindex.api.http.tally import Timings
from kvindex.api.http.traffic import TrafficObserver
from kvindex.api.load.model import LoadError
from kvindex.api.runtime import ApiDeps, Hooks, build_read_path
from kvindex.api.schemas import ErrorBody, decode_score_request
from kvindex.api.score import RequestError, UnknownModelError
from kvindex.api.tokenize.protocol import TokenizerError
from kvindex.indexer.domain.errors import KvIndexError, SettingsError
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.protocol import IndexUnavailableError, drop_replica

_JSON = "application/json"
_HEALTHY = msgspec.json.encode({"status": "ok"})
_READY = msgspec.json.encode({"status": "ready"})


class UnauthorizedError(KvIndexError):
    pass


class NotReadyError(KvIndexError):
    """``GET /readyz`` while the index store does not answer (503, the store's error)."""


class ApiCore:
    """One read path's answers and metrics, shared by the hot routes and FastAPI's."""

    def __init__(self, deps: ApiDeps) -> None:
        circuit = deps.circuit
        metrics = self.metrics = ApiMetrics(
            deps.registry,
            deps.index,
            runs_write_path=deps.runs_write_path,
            store_up=lambda: circuit is None or not circuit.is_open,
            rule_names=[rule.name for rule in deps.settings.rules],
        )
        hooks = Hooks(
            wrap_index=lambda index: TimedIndex(
                index, metrics.tally.timings(metrics.lookup_latency)
            ),
            on_degraded=lambda reason: metrics.degraded_answers.labels(reason).inc(),
            on_scrape_failure=lambda replica: metrics.scrape_failures.labels(replica).inc(),
        )
        self.read_path = read_path = build_read_path(deps, hooks)
        metrics.watch_block_sizes(read_path.block_sizes)
        metrics.registry.register(TokenizerCollector(read_path.tokenizers))
        self.deps = deps
        self.off_loop = read_path.off_loop
        self.index, self.scorer = read_path.index, read_path.scorer
        self.tokenizers, self.block_sizes = read_path.tokenizers, read_path.block_sizes
        self.url_policy = deps.settings.url_policy()
        self._score_latency: dict[str, Timings] = {}

    async def score(self, body: bytes, headers: Headers) -> bytes:
        """``POST /score``'s answer, for FastAPI's route and the hot ones."""
        started = time.perf_counter()
        request, packed = decode_score_request(body)
        answer = await self.scorer.score(request, headers, packed_tokens=packed)
        latency = self._score_latency.get(answer.policy)
        if latency is None:  # kept per policy: a few, and labels() costs a lock and a lookup
            series = self.metrics.score_latency.labels(answer.policy)
            latency = self._score_latency[answer.policy] = self.metrics.tally.timings(series)
        latency.observe(time.perf_counter() - started)
        self.metrics.count_rule(answer.rule)
        return msgspec.json.encode(answer)

    async def remove_replica(self, spec: ReplicaSpec) -> None:
        """Purge a replica's blocks and load, then unregister it. Store calls first: if the
        store is down (503) it stays registered, to retry; a subscriber writing in between
        purges again once it sees the replica gone."""
        await self.off_loop(drop_replica, self.index, spec.id)
        await self.off_loop(self.deps.loads.remove, spec.id)
        await self.off_loop(self.deps.registry.remove, spec.id)
        self.scorer.forget(spec.id)
        self.tokenizers.forget(spec.model)

    async def readyz(self, _body: bytes, _headers: Headers) -> bytes:
        """``GET /readyz``: ready once the index store answers; NotReadyError if it does not."""
        try:
            await self.off_loop(self.index.streams)
        except IndexUnavailableError as exc:
            raise NotReadyError(str(exc)) from exc
        return _READY

    def check_token(self, headers: Headers) -> None:
        """UnauthorizedError unless the bearer token is the configured one (if any)."""
        token = self.deps.settings.auth_token
        if token is None:
            return
        given = headers.get("authorization", "").encode()
        # Constant-time comparison: the answer time must not reveal a prefix of the token.
        if not secrets.compare_digest(given, f"Bearer {token}".encode()):
            raise UnauthorizedError("missing or wrong bearer token")

    def hot_routes(self) -> list[HotRoute]:
        """The routes answered without the framework, each its FastAPI route's answer."""
        return [
            _hot("GET", "/healthz", healthz, guarded=False, reads_body=False, bare=_HEALTHY),
            _hot("GET", "/readyz", self.readyz, guarded=False, reads_body=False, bare=True),
            _hot("POST", "/score", self.score, guarded=True, reads_body=True),
        ]

    def hot_serving(self, traffic: TrafficObserver) -> HotServing:
        """The hot routes for a server that answers them itself, counted by ``traffic``."""
        settings = self.deps.settings
        return HotServing.build(
            self.hot_routes(),
            authorize=self.check_token,
            error_response=error_response,
            observe=traffic.observe,
            max_body_bytes=settings.max_body_bytes,
            body_timeout_s=settings.body_timeout_s,
        )


def _hot(
    method: str,
    path: str,
    answer: Answer,
    *,
    guarded: bool,
    reads_body: bool,
    bare: bool | bytes = False,
) -> HotRoute:
    """``bare``: a bare route (bytes: its constant answer, what ``answer`` returns)."""
    constant = bare if isinstance(bare, bytes) else None
    return HotRoute(
        method,
        path,
        RouteName(path),
        answer,
        guarded=guarded,
        reads_body=reads_body,
        bare=bool(bare),
        constant=constant,
    )


async def healthz(_body: bytes, _headers: Headers) -> bytes:
    return _HEALTHY


def json_response(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status_code=status, media_type=_JSON)


_STATUS_OF: tuple[tuple[tuple[type[BaseException], ...], int, str], ...] = (
    (
        (
            msgspec.ValidationError,
            msgspec.DecodeError,
            RequestError,
            SettingsError,
            LoadError,
            UntrustedUrlError,
        ),
        422,
        "invalid_request",
    ),
    ((BodyTooLargeError,), 413, "body_too_large"),
    ((BodyTimeoutError,), 408, "body_timeout"),
    ((UnknownModelError,), 404, "unknown_model"),
    ((UnauthorizedError,), 401, "unauthorized"),
    ((TokenizerError,), 502, "tokenizer_failed"),
    ((IndexUnavailableError,), 503, "store_unavailable"),
)


def error_response(exc: Exception) -> Response:
    """The API's one error → HTTP mapping (500 for an error it does not name)."""
    if isinstance(exc, NotReadyError):
        return json_response({"status": "unavailable", "detail": str(exc)}, 503)
    for kinds, status, name in _STATUS_OF:
        if isinstance(exc, kinds):
            response = json_response(ErrorBody(name, str(exc)), status)
            if status == 401:  # RFC 6750: say which scheme to use
                response.headers["www-authenticate"] = 'Bearer realm="kvindex"'
            if status in (408, 413):  # the rest of the body is not read: end the connection
                response.headers["connection"] = "close"
            return response
    return json_response(ErrorBody("internal", str(exc)), 500)
