"""A simulated vLLM replica: a real prefix-cache block pool, vLLM's KV events, an OpenAI-like
API and a time model that makes load real; no GPU, no model, a toy tokenizer (or a real
``tokenizer.json``). Layers: :class:`Engine` (one event loop), :func:`create_app` (routes),
:class:`ReplicaSim`."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, get_args

import msgspec
import xxhash
import zmq
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from kvindex.api.http.background import BackgroundServer, ServerStartError
from kvindex.api.tokenize.protocol import TokenId
from kvindex.clients.fake_vllm.answers import (
    SimResult,
    StreamOptions,
    chat_response,
    completion_response,
    sse_chunks,
)
from kvindex.clients.fake_vllm.block_pool import Admission, BlockPool
from kvindex.clients.fake_vllm.engine_hash import engine_root
from kvindex.clients.fake_vllm.lies import LieError, Lies
from kvindex.clients.fake_vllm.publisher import EventPublisher
from kvindex.clients.fake_vllm.render import add_render_routes
from kvindex.clients.fake_vllm.token_routes import (
    error_answer,
    handle_embeddings,
    handle_tokenize,
    ok_answer,
    prompt_tokens,
)
from kvindex.clients.fake_vllm.tokenizer import (
    ChatFields,
    SimTokenizer,
    SimTokenizerError,
    sim_tokenizer,
    word_token,
)
from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.events import Event
from kvindex.indexer.ingest.wire import Encoding, ReplayLayout

_encode = msgspec.msgpack.encode
_json = msgspec.json.encode


class ReplicaSimError(KvIndexError):
    """Invalid simulator settings or a request the simulated replica refuses."""


class EndpointInUseError(ReplicaSimError):
    """An endpoint the replica binds is taken; ``setting`` names the field that chose it."""

    def __init__(self, setting: str, endpoint: str) -> None:
        super().__init__(f"{endpoint} is in use")
        self.setting = setting


# --- settings -------------------------------------------------------------------------------


_BOUND = ("ipc://", "inproc://")
LOOPBACK_EVENTS = "tcp://127.0.0.1:5557"
"""Where the PUB binds unless told (vLLM's own default, ``tcp://*:5557``, is every interface)."""


@dataclass(frozen=True, slots=True)
class ReplicaSimSettings:
    """Everything one simulated replica needs; validated on construction."""

    id: str = "r1"
    """Replica id, the middle of the topic ``kv@<id>@<model>``."""
    model: str = "demo-model"
    """Served model name (requests for another name are refused, unless a LoRA name)."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    capacity_blocks: int = 1024
    """Blocks in the pool; also bounds a request (``max_model_len = capacity * block_size``)."""
    events: str | None = None
    """PUB endpoint; vLLM's rule: bind with ``*``/``::``, else connect (None: bind loopback)."""
    replay: str | None = "tcp://127.0.0.1:5558"
    """Replay ROUTER endpoint (always bound); None disables replay."""
    bind_events: bool | None = None
    """Override vLLM's bind/connect rule for ``events`` (True: bind exactly there)."""
    host: str = "127.0.0.1"
    """HTTP listen address."""
    port: int = 8001
    """HTTP listen port (0: any free port, see :attr:`ReplicaSim.base_url`)."""
    encoding: Encoding = "map"
    """Event encoding: ``map`` (vLLM ≥ 0.24) or ``array`` (≤ 0.23)."""
    replay_layout: ReplayLayout = "topic"
    """Replay reply layout: ``topic`` (vLLM ≥ 0.26) or ``legacy``."""
    prefill_tps: float = 8_000.0
    """Prefill throughput of one request, prompt tokens per simulated second."""
    decode_tps: float = 50.0
    """Decode throughput of one request, output tokens per simulated second."""
    max_running: int = 8
    """Requests running at once; the others wait (FIFO)."""
    speed: float = 1.0
    """Time compression: real sleep = simulated time / speed."""
    seed: int | None = None
    """Seed of the engine-hash chain root (vLLM's NONE_HASH); None: random per process."""
    lora_names: tuple[str, ...] = ()
    """LoRA adapters served: a request whose ``model`` is one of these uses that adapter."""
    send_hwm: int = 0
    """The PUB's high-water mark in messages (0: unbounded); past it frames are dropped."""
    send_buffer_bytes: int = 0
    """The PUB's kernel send buffer per connection (0: the OS default)."""
    api_key: str | None = None
    """As vLLM's ``--api-key``: every ``/v1`` route needs this bearer token; None: open."""
    fail_status: int = 0
    """Test knob: answer every completion with this HTTP status (0: never)."""
    stream_stall_s: float = 0.0
    """Test knob: a stream waits this long (real seconds) after its first chunk (0: never)."""
    tokenizer: str | None = None
    """A ``tokenizer.json`` to tokenize with, as vLLM does with the model's (None: the toy one)."""
    chat_template: str | None = None
    """Its chat template (None: ``chat_template.jinja`` or ``tokenizer_config.json`` beside it)."""
    enable_scale_out: bool = False  # vLLM's flag: the render routes served (else 404)
    enable_prompt_tokens_details: bool = True
    """As vLLM's ``--enable-prompt-tokens-details``: ``usage.prompt_tokens_details.cached_tokens``
    in every answer (False: absent, as vLLM without the flag)."""
    lies: tuple[str, ...] = ()
    """Test knob: the ways it lies (:mod:`.lies`: ``drop-removals``, ``block-size=N``...)."""

    def __post_init__(self) -> None:
        self._check_test_knobs()
        self._check_tokenizer()
        for name in ("send_hwm", "send_buffer_bytes"):
            if getattr(self, name) < 0:
                raise ReplicaSimError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("block_size", "capacity_blocks", "max_running"):
            if getattr(self, name) < 1:
                raise ReplicaSimError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("prefill_tps", "decode_tps", "speed"):
            if not getattr(self, name) > 0:
                raise ReplicaSimError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.encoding not in get_args(Encoding):
            raise ReplicaSimError(f"encoding must be map or array, got {self.encoding!r}")
        if self.replay_layout not in get_args(ReplayLayout):
            raise ReplicaSimError(
                f"replay_layout must be topic or legacy, got {self.replay_layout!r}"
            )
        if not self.id or "@" in self.id or not self.model:
            raise ReplicaSimError(f"id and model must be non-empty, id without '@': {self.id!r}")

    def _check_tokenizer(self) -> None:
        if self.chat_template is not None and self.tokenizer is None:
            raise ReplicaSimError("chat_template needs tokenizer")
        try:
            sim_tokenizer(self.tokenizer, self.chat_template)  # an unreadable file fails here
        except SimTokenizerError as exc:
            raise ReplicaSimError(str(exc)) from exc

    def _check_test_knobs(self) -> None:
        if self.fail_status and not 400 <= self.fail_status <= 599:
            raise ReplicaSimError(f"fail_status must be 0 or 400..599, got {self.fail_status!r}")
        if self.stream_stall_s < 0:
            raise ReplicaSimError(f"stream_stall_s must be >= 0, got {self.stream_stall_s!r}")
        try:
            Lies(self.lies)
        except LieError as exc:
            raise ReplicaSimError(str(exc)) from exc

    @property
    def topic(self) -> str:
        return f"kv@{self.id}@{self.model}"

    @property
    def events_bound(self) -> bool:
        """Whether the PUB binds ``events`` (vLLM's rule, or ``bind_events``) or connects."""
        if self.events is None:
            return True
        if self.bind_events is not None:
            return self.bind_events
        return "*" in self.events or "::" in self.events or self.events.startswith(_BOUND)

    @property
    def max_model_len(self) -> int:
        return self.capacity_blocks * self.block_size


def settings_tokenizer(settings: ReplicaSimSettings) -> SimTokenizer:
    return sim_tokenizer(settings.tokenizer, settings.chat_template)


def output_words(prompt: Sequence[int], num_tokens: int) -> list[str]:
    """The 'generated' words: a deterministic function of the prompt."""
    seed = xxhash.xxh3_64_intdigest(_encode(list(prompt[-8:])))
    return [f"w{(seed + i * 7919) % 1000}" for i in range(num_tokens)]


# --- time model and scheduler -----------------------------------------------------------------


def service_times(
    num_uncached_tokens: int, max_tokens: int, prefill_tps: float, decode_tps: float
) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of one request, in simulated time."""
    return num_uncached_tokens / prefill_tps, max_tokens / decode_tps


@dataclass(frozen=True, slots=True)
class SimRequest:
    prompt: list[int]
    max_tokens: int
    lora_name: str | None = None
    cache_salt: str | None = None


@dataclass
class _Waiting:
    request_id: int
    request: SimRequest
    future: asyncio.Future[Admission]
    enqueued_at: float
    admitted_at: float = 0.0


@dataclass
class EngineCounters:
    num_running: int = 0
    num_prompt_tokens_queried: int = 0
    num_prompt_tokens_hit: int = 0
    num_finished: int = 0


class Engine:
    """FIFO scheduler over a :class:`BlockPool` (one event loop): admits while fewer than
    ``max_running`` run and the pool has room; one batch of events per admission and end."""

    def __init__(
        self,
        settings: ReplicaSimSettings,
        cache: BlockPool,
        publish: Callable[[list[Event]], object],
        *,
        clock: Callable[[], float] = time.monotonic,
        lies: Lies | None = None,
        on_restart: Callable[[], object] = lambda: None,
    ) -> None:
        self.settings = settings
        self.cache = cache
        self._publish = publish
        self._clock = clock
        self.lies = Lies() if lies is None else lies
        self._on_restart = on_restart
        self._restart_due = False
        self._waiting: collections.deque[_Waiting] = collections.deque()
        self._next_id = 0
        self.counters = EngineCounters()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    async def run(self, request: SimRequest) -> SimResult:
        """Queue, run and finish one request (:class:`ReplicaSimError` when it can never fit)."""
        total = len(request.prompt) + request.max_tokens
        if not request.prompt or total > self.settings.max_model_len:
            raise ReplicaSimError(
                f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.max_tokens}) "
                f"must be in [1, max_model_len={self.settings.max_model_len}]"
            )
        request_id, self._next_id = self._next_id, self._next_id + 1
        future = asyncio.get_running_loop().create_future()
        waiting = _Waiting(request_id, request, future, self._clock())
        self._waiting.append(waiting)
        self._admit()
        try:
            admission = await waiting.future
        except asyncio.CancelledError:
            if waiting.future.done() and not waiting.future.cancelled():
                self._finish(request_id)  # admitted just as the caller went away
            raise
        queue_s = (waiting.admitted_at - waiting.enqueued_at) * self.settings.speed
        try:
            return await self._execute(request_id, request, admission, queue_s)
        finally:
            self._finish(request_id)

    def _finish(self, request_id: int) -> None:
        self.cache.release(request_id)
        self.counters.num_running -= 1
        if self._restart_due and not self.counters.num_running:
            self._restart()
        self._admit()

    def _restart(self) -> None:
        self._restart_due = False
        s, old = self.settings, self.cache
        self.cache = self.lies.pool(s.capacity_blocks, s.block_size, old.root)
        self._on_restart()

    async def _execute(
        self, request_id: int, request: SimRequest, admission: Admission, queue_s: float
    ) -> SimResult:
        cached = admission.num_hit_blocks * self.cache.block_size
        prefill_s, decode_s = service_times(
            len(request.prompt) - cached,
            request.max_tokens,
            self.settings.prefill_tps,
            self.settings.decode_tps,
        )
        await asyncio.sleep((prefill_s + decode_s) / self.settings.speed)
        words = output_words(request.prompt, request.max_tokens)
        output_tokens = [word_token(w) for w in words]
        self._emit(self.cache.cache_full_blocks(request_id, request.prompt + output_tokens))
        self.counters.num_finished += 1
        self._restart_due = self.lies.restart_due() or self._restart_due
        return SimResult(words, output_tokens, cached, queue_s, prefill_s, decode_s)

    def _admit(self) -> None:
        while self._waiting and self.counters.num_running < self.settings.max_running:
            head = self._waiting[0]
            if head.future.done():  # the caller went away while waiting
                self._waiting.popleft()
                continue
            req = head.request
            admission = self.cache.admit(
                head.request_id,
                req.prompt,
                len(req.prompt) + req.max_tokens,
                lora_name=req.lora_name,
                cache_salt=req.cache_salt,
            )
            if admission is None:
                return
            self._waiting.popleft()
            self.counters.num_running += 1
            self.counters.num_prompt_tokens_queried += len(req.prompt)
            self.counters.num_prompt_tokens_hit += admission.num_hit_blocks * self.cache.block_size
            self._emit(admission.events)
            head.admitted_at = self._clock()
            head.future.set_result(admission)

    def _emit(self, events: list[Event]) -> None:
        events = self.lies.published(events)
        if events:
            self._publish(events)


# --- HTTP -------------------------------------------------------------------------------------


class CompletionBody(msgspec.Struct):
    model: str
    prompt: str | list[TokenId]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 16
    lora_name: str | None = None
    cache_salt: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class ChatBody(ChatFields, kw_only=True):
    """``/v1/chat/completions``: the whole conversation is the prompt (:func:`render_chat`)."""

    model: str
    messages: list[dict[str, Any]]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 16
    lora_name: str | None = None
    cache_salt: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


def _lora_for(settings: ReplicaSimSettings, body: CompletionBody | ChatBody) -> str | None:
    """The request's LoRA name; raises ReplicaSimError for an unknown model."""
    if body.model in settings.lora_names:
        return body.model
    if body.model != settings.model:
        raise ReplicaSimError(f"The model `{body.model}` does not exist.")
    return body.lora_name


def metrics_text(engine: Engine) -> str:
    """Prometheus text with vLLM's metric names."""
    label = '{model_name="' + engine.settings.model.replace('"', '\\"') + '"}'
    c = engine.counters
    rows = [
        ("vllm:num_requests_running", "gauge", c.num_running),
        ("vllm:num_requests_waiting", "gauge", engine.num_waiting),
        ("vllm:kv_cache_usage_perc", "gauge", engine.cache.usage),
        ("vllm:prefix_cache_queries_total", "counter", c.num_prompt_tokens_queried),
        ("vllm:prefix_cache_hits_total", "counter", c.num_prompt_tokens_hit),
    ]
    lines: list[str] = []
    for name, kind, value in rows:
        lines += [f"# TYPE {name} {kind}", f"{name}{label} {float(value)}"]
    return "\n".join(lines) + "\n"


def _sse(chunks: list[bytes], stall_s: float = 0.0) -> Response:
    async def body() -> Any:
        for i, chunk in enumerate(chunks):
            yield chunk
            if i == 0 and stall_s:
                await asyncio.sleep(stall_s)

    return StreamingResponse(body(), media_type="text/event-stream")


async def handle_completion(engine: Engine, raw: bytes, *, chat: bool = False) -> Response:
    """``POST /v1/completions`` (``chat``: ``/v1/chat/completions``), OpenAI-style."""
    settings = engine.settings
    if settings.fail_status:
        return error_answer(settings.fail_status, "failure injected (fail_status)")
    try:
        body = msgspec.json.decode(raw, type=ChatBody if chat else CompletionBody)
        lora = _lora_for(settings, body)
    except msgspec.DecodeError as exc:  # ValidationError included
        return error_answer(400, str(exc))
    except ReplicaSimError as exc:
        return error_answer(404, str(exc))
    if body.stream_options is not None and not body.stream:  # vLLM's own check
        return error_answer(400, "Stream options can only be defined when `stream=True`.")
    tokenizer = settings_tokenizer(settings)
    try:
        if isinstance(body, ChatBody):
            prompt = tokenizer.chat(body.messages, body.options())
        else:
            prompt = prompt_tokens(body.prompt, tokenizer)
    except SimTokenizerError as exc:
        return error_answer(400, str(exc))
    prompt = engine.lies.prompt(prompt)
    try:
        result = await engine.run(SimRequest(prompt, body.max_tokens, lora, body.cache_salt))
    except ReplicaSimError as exc:
        return error_answer(400, str(exc))
    shape = chat_response if chat else completion_response
    answer = shape(settings, len(prompt), result)
    if body.stream:
        include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
        chunks = sse_chunks(answer, chat=chat, include_usage=include_usage)
        return _sse(chunks, settings.stream_stall_s)
    return ok_answer(answer)


def _refused(settings: ReplicaSimSettings, request: Request) -> Response | None:
    """A 401 when ``api_key`` is set and the request does not carry it (vLLM's check)."""
    if settings.api_key is None:
        return None
    if request.headers.get("authorization") == f"Bearer {settings.api_key}":
        return None
    return Response(_json({"error": "Unauthorized"}), 401, media_type="application/json")


class CachedBody(msgspec.Struct):
    prompts: list[str | list[TokenId]]


def handle_cached(engine: Engine, raw: bytes) -> Response:
    """``POST /kvsim/cached`` (a test oracle): the leading full blocks of each prompt that the
    pool holds, and its block count; reads only."""
    try:
        body = msgspec.json.decode(raw, type=CachedBody)
    except msgspec.DecodeError as exc:
        return error_answer(400, str(exc))
    cache = engine.cache
    counts = []
    for prompt in body.prompts:
        tokens = prompt_tokens(prompt, settings_tokenizer(engine.settings))
        chain = cache.chain(engine.lies.prompt(tokens))
        held = (i for i, block in enumerate(chain) if not cache.is_cached(block))
        counts.append(next(held, len(chain)))
    return ok_answer({"num_cached_blocks": counts, "num_pool_blocks": cache.num_cached_blocks})


def create_app(engine: Engine) -> FastAPI:
    """vLLM's routes (``/v1/*`` checking ``api_key``), ``/metrics``, and ``/kvsim/cached``."""
    app = FastAPI(title=f"kvindex replica simulator {engine.settings.id}")
    settings = engine.settings
    add_render_routes(
        app,
        settings,
        lambda prompt: prompt_tokens(prompt, settings_tokenizer(settings)),
        lambda messages, options: settings_tokenizer(settings).chat(messages, options),
        refused=_refused,
        error=error_answer,
    )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        refused = _refused(settings, request)
        return refused or await handle_completion(engine, await request.body())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        refused = _refused(settings, request)
        return refused or await handle_completion(engine, await request.body(), chat=True)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return _refused(settings, request) or handle_embeddings(settings, await request.body())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return handle_tokenize(engine.settings, await request.body())

    @app.post("/kvsim/cached")
    async def cached(request: Request) -> Response:
        return handle_cached(engine, await request.body())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(metrics_text(engine), media_type="text/plain; version=0.0.4")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


# --- the process --------------------------------------------------------------------------------


@dataclass
class ReplicaSim:
    """A simulated replica: publisher + engine + uvicorn in a background thread; ``start()``
    returns once it listens (:class:`EndpointInUseError` when an endpoint is taken)."""

    settings: ReplicaSimSettings
    publisher: EventPublisher | None = None
    engine: Engine | None = None
    _server: BackgroundServer | None = None
    _port: int = field(default=0)

    def start(self) -> None:
        s = self.settings
        events = LOOPBACK_EVENTS if s.events is None else s.events
        try:
            self.publisher = EventPublisher(
                events,
                s.replay,
                topic=s.topic,
                encoding=s.encoding,
                replay_layout=s.replay_layout,
                bind=s.events_bound,
                send_hwm=s.send_hwm,
                send_buffer_bytes=s.send_buffer_bytes,
            )
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE:
                raise
            taken = (
                ("replay", s.replay) if s.replay and s.replay in str(exc) else ("events", events)
            )
            raise EndpointInUseError(*taken) from None
        lies = Lies(s.lies)
        cache = lies.pool(s.capacity_blocks, s.block_size, engine_root(s.seed))
        publisher = self.publisher
        self.engine = Engine(s, cache, publisher.publish, lies=lies, on_restart=publisher.mute)
        try:
            self._serve(create_app(self.engine))
        except BaseException:
            self.stop()
            raise

    def _serve(self, app: FastAPI) -> None:
        s = self.settings
        self._server = BackgroundServer(
            app, host=s.host, port=s.port, lifespan="off", name="replica-sim"
        )
        try:
            self._server.start()
        except ServerStartError as exc:
            raise ReplicaSimError(str(exc)) from exc
        self._port = self._server.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
        self._server = None
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def __enter__(self) -> ReplicaSim:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        return f"http://{self.settings.host}:{self._port}"

    @property
    def events_endpoint(self) -> str:
        assert self.publisher is not None, "not started"
        return self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        assert self.publisher is not None, "not started"
        return self.publisher.replay_endpoint
