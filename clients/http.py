"""Python client of the kvindex HTTP API, sync (:class:`KvIndexClient`) and asyncio, on shared
request descriptions (:class:`_Call`); failures raise :class:`KvIndexClientError`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, NoReturn, Self, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from kvindex.api.schemas import (
    ErrorBody,
    LoadReport,
    ReplicaIn,
    ReplicaView,
    ScoreRequest,
    ScoreResponse,
)
from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.keys import BlockKeyError, block_keys

__all__ = [
    "AsyncKvIndexClient",
    "BadRequestError",
    "KvIndexClient",
    "KvIndexClientError",
    "NotFoundError",
    "UnauthorizedError",
    "UnavailableError",
    "UnreachableError",
]

T = TypeVar("T")
_JSON = "application/json"
_MAX_DETAIL = 500
"""Characters of a non-JSON error body kept as the detail (a proxy's HTML page, say)."""


# --- errors ---------------------------------------------------------------------------------


class KvIndexClientError(KvIndexError):
    """A call failed: HTTP ``status`` (None: no answer, or a client check), ``kind``, ``detail``."""

    def __init__(self, kind: str, detail: str, status: int | None = None) -> None:
        super().__init__(kind, detail, status)  # all in args: the error pickles
        self.kind = kind
        self.detail = detail
        self.status = status

    def __str__(self) -> str:
        where = f"HTTP {self.status}" if self.status is not None else "client"
        return f"{self.kind} ({where}): {self.detail}"


class BadRequestError(KvIndexClientError):
    """The request cannot be answered as sent (HTTP 422, or 400); the detail names the field."""


class NotFoundError(KvIndexClientError):
    """HTTP 404: an unknown model (the detail lists the known ones) or replica."""


class UnauthorizedError(KvIndexClientError):
    """HTTP 401: the bearer token is missing or wrong."""


class UnavailableError(KvIndexClientError):
    """HTTP 503 (the index store is unreachable) or 502 (a tokenizer or proxy failed)."""


class UnreachableError(KvIndexClientError):
    """No answer: connection refused or reset, a timeout, a broken HTTP exchange."""


_STATUS_TO_ERROR: dict[int, type[KvIndexClientError]] = {
    400: BadRequestError,
    401: UnauthorizedError,
    404: NotFoundError,
    422: BadRequestError,
    502: UnavailableError,
    503: UnavailableError,
}


def _error_from_response(response: httpx.Response) -> KvIndexClientError:
    """The error an unsuccessful answer stands for (any status without a subclass: the base)."""
    kind, detail = _error_fields(response)
    error_type = _STATUS_TO_ERROR.get(response.status_code, KvIndexClientError)
    return error_type(kind, detail, response.status_code)


def _error_fields(response: httpx.Response) -> tuple[str, str]:
    """``(kind, detail)`` from kvindex's error body, FastAPI's ``{"detail"}``, or raw text."""
    try:
        body = msgspec.json.decode(response.content, type=ErrorBody)
        return body.error, body.detail
    except msgspec.MsgspecError:
        pass
    fallback = f"http_{response.status_code}"
    try:
        loose = msgspec.json.decode(response.content)
    except msgspec.MsgspecError:
        return fallback, response.text[:_MAX_DETAIL]
    if isinstance(loose, dict) and "detail" in loose:
        return str(loose.get("error", fallback)), str(loose["detail"])
    return fallback, response.text[:_MAX_DETAIL]


def _reraise(error: UnreachableError) -> NoReturn:
    raise error


# --- the shared half: request descriptions --------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Call(Generic[T]):
    """One HTTP exchange, described; ``unreachable`` stands for an answer when none came."""

    method: str
    path: str
    read: Callable[[httpx.Response], T]
    body: bytes | None = None
    unreachable: Callable[[UnreachableError], T] = _reraise


def _encode_body(struct: msgspec.Struct) -> bytes:
    """JSON of a request without None fields and flags left at their default (older servers)."""
    values = msgspec.structs.asdict(struct)
    sent = {
        f.name: values[f.name]
        for f in msgspec.structs.fields(struct)
        if values[f.name] is not None
        and not (isinstance(values[f.name], bool) and values[f.name] == f.default)
    }
    return msgspec.json.encode(sent)


def _decoded(kind: type[T]) -> Callable[[httpx.Response], T]:
    """A reader that raises the answer's error, else decodes its body as ``kind``."""

    def read(response: httpx.Response) -> T:
        _check(response)
        try:
            return msgspec.json.decode(response.content, type=kind)
        except msgspec.MsgspecError as exc:
            raise KvIndexClientError("invalid_response", str(exc), response.status_code) from exc

    return read


def _check(response: httpx.Response) -> None:
    if not response.is_success:
        raise _error_from_response(response)


def _created(response: httpx.Response) -> bool:
    _check(response)
    return response.status_code == 201


def _is_200(response: httpx.Response) -> bool:
    return response.status_code == 200


def _down(_: UnreachableError) -> bool:
    return False


def _listed(values: Sequence[T] | None) -> list[T] | None:
    return values if values is None or isinstance(values, list) else list(values)


def _score_request(
    model: str,
    *,
    token_ids: Sequence[int] | None = None,
    prompt: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    block_keys: Sequence[int] | None = None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    session: str | None = None,
    candidates: Sequence[str] | None = None,
    policy: str | None = None,
    weights: Mapping[str, float] | None = None,
    top_k: int | None = None,
    dry_run: bool = False,
    workload: str | None = None,
) -> ScoreRequest:
    return ScoreRequest(
        model=model,
        token_ids=_listed(token_ids),
        prompt=prompt,
        messages=messages,
        block_keys=_listed(block_keys),
        lora_name=lora_name,
        cache_salt=cache_salt,
        session=session,
        candidates=_listed(candidates),
        policy=policy,
        weights=None if weights is None else dict(weights),
        top_k=top_k,
        dry_run=dry_run,
        workload=workload,
    )


def _score_call(request: ScoreRequest) -> _Call[ScoreResponse]:
    return _Call("POST", "/score", _decoded(ScoreResponse), _encode_body(request))


def _score_tokens_call(
    request: ScoreRequest, *, block_size: int, compute_keys: bool
) -> _Call[ScoreResponse]:
    """``POST /score`` of ``request.token_ids``, as block keys when ``compute_keys``;
    :class:`BadRequestError` for bad token ids or a server block size not ``block_size``."""
    if not compute_keys:
        return _score_call(request)
    assert request.token_ids is not None, "score_tokens always sets token_ids"
    try:
        keys = block_keys(
            request.model,
            request.token_ids,
            block_size,
            lora_name=request.lora_name,
            cache_salt=request.cache_salt,
        )
    except BlockKeyError as exc:
        raise BadRequestError("invalid_request", f"token_ids: {exc}") from exc
    keyed = msgspec.structs.replace(
        request,
        token_ids=None,
        block_keys=keys,
        block_size=block_size,
        lora_name=None,
        cache_salt=None,
    )
    return _Call("POST", "/score", _same_block_size(block_size), _encode_body(keyed))


def _same_block_size(block_size: int) -> Callable[[httpx.Response], ScoreResponse]:
    decode = _decoded(ScoreResponse)

    def read(response: httpx.Response) -> ScoreResponse:
        answer = decode(response)
        if answer.block_size != block_size:
            raise BadRequestError(
                "block_size_mismatch",
                f"keys computed with block_size={block_size}, but the index uses"
                f" {answer.block_size} for {answer.model!r} (see GET /config)",
            )
        return answer

    return read


def _load_call(report: LoadReport) -> _Call[None]:
    return _Call("POST", "/load", _check, _encode_body(report))


def _replicas_call() -> _Call[list[ReplicaView]]:
    return _Call("GET", "/replicas", _decoded(list[ReplicaView]))


def _add_replica_call(replica: ReplicaIn) -> _Call[bool]:
    """``POST /replicas``: True when created or changed, False when already identical."""
    return _Call("POST", "/replicas", _created, _encode_body(replica))


def _remove_replica_call(replica_id: str) -> _Call[None]:
    return _Call("DELETE", f"/replicas/{quote(replica_id, safe='')}", _check)


def _stats_call() -> _Call[dict[str, Any]]:
    return _Call("GET", "/stats", _decoded(dict[str, Any]))


def _config_call() -> _Call[dict[str, Any]]:
    return _Call("GET", "/config", _decoded(dict[str, Any]))


def _probe_call(path: str) -> _Call[bool]:
    """``GET /healthz`` or ``/readyz``: True on 200; False on any other answer or none."""
    return _Call("GET", path, _is_200, unreachable=_down)


# --- the I/O half ---------------------------------------------------------------------------


class _Endpoint:
    def __init__(self, base_url: str, token: str | None, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = httpx.Timeout(timeout_s)
        self.auth = {"authorization": f"Bearer {token}"} if token is not None else {}

    def url(self, call: _Call[Any]) -> str:
        return self.base_url + call.path

    def headers(self, call: _Call[Any]) -> dict[str, str]:
        if call.body is None:
            return self.auth
        return {**self.auth, "content-type": _JSON}

    def unreachable(self, call: _Call[T], exc: httpx.HTTPError) -> T:
        detail = f"{call.method} {self.url(call)}: {type(exc).__name__}: {exc}"
        return call.unreachable(UnreachableError("unreachable", detail))


class KvIndexClient:
    """Sync client; thread-safe. ``timeout_s`` bounds every phase of every request."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout_s: float = 5.0,
        http: httpx.Client | None = None,
    ) -> None:
        self._endpoint = _Endpoint(base_url, token, timeout_s)
        self._owns_http = http is None
        self._http = http if http is not None else httpx.Client()

    def _run(self, call: _Call[T]) -> T:
        endpoint = self._endpoint
        try:
            response = self._http.request(
                call.method,
                endpoint.url(call),
                content=call.body,
                headers=endpoint.headers(call),
                timeout=endpoint.timeout,
            )
        except httpx.HTTPError as exc:
            return endpoint.unreachable(call, exc)
        return call.read(response)

    def close(self) -> None:
        """Close the HTTP client if this object created it."""
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def score(
        self,
        model: str,
        *,
        token_ids: Sequence[int] | None = None,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        block_keys: Sequence[int] | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        session: str | None = None,
        candidates: Sequence[str] | None = None,
        policy: str | None = None,
        weights: Mapping[str, float] | None = None,
        top_k: int | None = None,
        dry_run: bool = False,
        workload: str | None = None,
    ) -> ScoreResponse:
        """Rank the replicas serving ``model`` for one of token_ids, prompt, messages or
        block_keys; ``top_k`` 0: every candidate, None: the server's default."""
        request = _score_request(
            model,
            token_ids=token_ids,
            prompt=prompt,
            messages=messages,
            block_keys=block_keys,
            lora_name=lora_name,
            cache_salt=cache_salt,
            session=session,
            candidates=candidates,
            policy=policy,
            weights=weights,
            top_k=top_k,
            dry_run=dry_run,
            workload=workload,
        )
        return self._run(_score_call(request))

    def score_tokens(
        self,
        model: str,
        token_ids: Sequence[int],
        *,
        block_size: int,
        compute_keys: bool = True,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        session: str | None = None,
        candidates: Sequence[str] | None = None,
        policy: str | None = None,
        weights: Mapping[str, float] | None = None,
        top_k: int | None = None,
        dry_run: bool = False,
        workload: str | None = None,
    ) -> ScoreResponse:
        """``score(model, token_ids=...)`` sent as block keys computed here (full blocks only)."""
        request = _score_request(
            model,
            token_ids=token_ids,
            lora_name=lora_name,
            cache_salt=cache_salt,
            session=session,
            candidates=candidates,
            policy=policy,
            weights=weights,
            top_k=top_k,
            dry_run=dry_run,
            workload=workload,
        )
        call = _score_tokens_call(request, block_size=block_size, compute_keys=compute_keys)
        return self._run(call)

    def report_load(
        self,
        replica: str,
        running: float,
        waiting: float,
        kv_usage: float = 0.0,
        ts: float | None = None,
    ) -> None:
        """Push a registered replica's load (``ts``: unix seconds measured, default now)."""
        report = LoadReport(
            replica=replica, running=running, waiting=waiting, kv_usage=kv_usage, ts=ts
        )
        self._run(_load_call(report))

    def replicas(self) -> list[ReplicaView]:
        """Every registered replica with its streams' freshness and its load."""
        return self._run(_replicas_call())

    def add_replica(
        self,
        id: str,
        model: str,
        *,
        events: str | None = None,
        replay: str | None = None,
        url: str | None = None,
        dp_size: int = 1,
    ) -> bool:
        """Register or update a replica; False when an identical one was already there."""
        replica = ReplicaIn(
            id=id, model=model, events=events, replay=replay, url=url, dp_size=dp_size
        )
        return self._run(_add_replica_call(replica))

    def remove_replica(self, id: str) -> None:
        """Forget a replica and purge its blocks; :class:`NotFoundError` if unknown."""
        self._run(_remove_replica_call(id))

    def stats(self) -> dict[str, Any]:
        """Index and ingestion totals (``GET /stats``)."""
        return self._run(_stats_call())

    def config(self) -> dict[str, Any]:
        """Default policy, weights, and each known model's block size (``GET /config``)."""
        return self._run(_config_call())

    def healthy(self) -> bool:
        """True when the process answers ``/healthz``; never raises."""
        return self._run(_probe_call("/healthz"))

    def ready(self) -> bool:
        """True when ``/readyz`` says the index store is reachable; never raises."""
        return self._run(_probe_call("/readyz"))


class AsyncKvIndexClient:
    """Asyncio client with :class:`KvIndexClient`'s methods and contracts; one event loop."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout_s: float = 5.0,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self._endpoint = _Endpoint(base_url, token, timeout_s)
        self._owns_http = http is None
        self._http = http if http is not None else httpx.AsyncClient()

    async def _run(self, call: _Call[T]) -> T:
        endpoint = self._endpoint
        try:
            response = await self._http.request(
                call.method,
                endpoint.url(call),
                content=call.body,
                headers=endpoint.headers(call),
                timeout=endpoint.timeout,
            )
        except httpx.HTTPError as exc:
            return endpoint.unreachable(call, exc)
        return call.read(response)

    async def close(self) -> None:
        """Close the HTTP client if this object created it."""
        if self._owns_http:
            await self._http.aclose()

    async def aclose(self) -> None:
        await self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def score(
        self,
        model: str,
        *,
        token_ids: Sequence[int] | None = None,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        block_keys: Sequence[int] | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        session: str | None = None,
        candidates: Sequence[str] | None = None,
        policy: str | None = None,
        weights: Mapping[str, float] | None = None,
        top_k: int | None = None,
        dry_run: bool = False,
        workload: str | None = None,
    ) -> ScoreResponse:
        request = _score_request(
            model,
            token_ids=token_ids,
            prompt=prompt,
            messages=messages,
            block_keys=block_keys,
            lora_name=lora_name,
            cache_salt=cache_salt,
            session=session,
            candidates=candidates,
            policy=policy,
            weights=weights,
            top_k=top_k,
            dry_run=dry_run,
            workload=workload,
        )
        return await self._run(_score_call(request))

    async def score_tokens(
        self,
        model: str,
        token_ids: Sequence[int],
        *,
        block_size: int,
        compute_keys: bool = True,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        session: str | None = None,
        candidates: Sequence[str] | None = None,
        policy: str | None = None,
        weights: Mapping[str, float] | None = None,
        top_k: int | None = None,
        dry_run: bool = False,
        workload: str | None = None,
    ) -> ScoreResponse:
        request = _score_request(
            model,
            token_ids=token_ids,
            lora_name=lora_name,
            cache_salt=cache_salt,
            session=session,
            candidates=candidates,
            policy=policy,
            weights=weights,
            top_k=top_k,
            dry_run=dry_run,
            workload=workload,
        )
        call = _score_tokens_call(request, block_size=block_size, compute_keys=compute_keys)
        return await self._run(call)

    async def report_load(
        self,
        replica: str,
        running: float,
        waiting: float,
        kv_usage: float = 0.0,
        ts: float | None = None,
    ) -> None:
        report = LoadReport(
            replica=replica, running=running, waiting=waiting, kv_usage=kv_usage, ts=ts
        )
        await self._run(_load_call(report))

    async def replicas(self) -> list[ReplicaView]:
        return await self._run(_replicas_call())

    async def add_replica(
        self,
        id: str,
        model: str,
        *,
        events: str | None = None,
        replay: str | None = None,
        url: str | None = None,
        dp_size: int = 1,
    ) -> bool:
        replica = ReplicaIn(
            id=id, model=model, events=events, replay=replay, url=url, dp_size=dp_size
        )
        return await self._run(_add_replica_call(replica))

    async def remove_replica(self, id: str) -> None:
        await self._run(_remove_replica_call(id))

    async def stats(self) -> dict[str, Any]:
        return await self._run(_stats_call())

    async def config(self) -> dict[str, Any]:
        return await self._run(_config_call())

    async def healthy(self) -> bool:
        return await self._run(_probe_call("/healthz"))

    async def ready(self) -> bool:
        return await self._run(_probe_call("/readyz"))
