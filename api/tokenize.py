"""Text and chat messages → token ids, per model, for the scoring API.

A ``POST /score`` request may carry ``token_ids``, a ``prompt`` (text) or ``messages``
(OpenAI chat messages: the whole conversation, rendered with the model's chat template).
Block keys are computed from token ids, so text must be tokenized exactly as the engine
does. Two :class:`Tokenizer` implementations:

- :class:`LocalTokenizer`: a Hugging Face ``tokenizer.json`` (the ``tokenizers`` package)
  plus the model's Jinja2 chat template, rendered like ``transformers``'
  ``apply_chat_template(..., add_generation_prompt=True, tokenize=False)``.
- :class:`ReplicaTokenizer`: the replica's own vLLM ``POST /tokenize`` endpoint, which
  guarantees the exact tokens the engine sees (its chat-message normalisation included).

:class:`CachingTokenizer` wraps either with an LRU cache (repeated system prompts and
conversations are the common case). :func:`build_tokenizer` assembles one from a
:class:`TokenizerSpec`. Every failure is a :class:`TokenizerError`.

Special tokens follow vLLM's defaults: a prompt is encoded *with* special tokens (the
completions path), a rendered conversation *without* (its template already has them).
"""

from __future__ import annotations

import asyncio
import json
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, Protocol, Self, TypeAlias, get_args

import httpx
import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
import msgspec
import tokenizers

from kvindex.indexer.errors import KvIndexError

TokenizerKind = Literal["local", "replica"]

INLINE_MAX_CHARS = 2048
"""Texts up to this long are encoded on the event loop; longer ones in a worker thread.

Measured (2-core machine, 32k-vocab byte-level BPE): ~0.5-0.7 µs per character, so 2048
characters (~600 tokens) block the loop under 1 ms, while ~8k tokens take 10-20 ms."""

_EXCERPT_CHARS = 200
_CHAT_TEMPLATE_FILE = "chat_template.jinja"
_TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token")
_JSON_HEADERS = {"content-type": "application/json"}


class TokenizerError(KvIndexError):
    """Text or messages could not be tokenized; the message says which model source and why."""


class Tokenizer(Protocol):
    """Turns a prompt or a chat conversation into the token ids one model's engine sees.

    Implementations return a fresh list the caller may keep or mutate, and raise only
    :class:`TokenizerError`.
    """

    async def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a completions prompt, special tokens (e.g. BOS) added."""
        ...

    async def encode_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the whole conversation rendered with the chat template, with the
        generation prompt added and no special tokens beyond the template's own."""
        ...


# --- chat templates ---------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (HF's assistant-mask marker) renders its body."""

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        self.tags = {"generation"}  # the parser reads the instance's tags

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's override: plain json.dumps, not Jinja's HTML-escaping tojson (tokens would differ).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _chat_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The environment ``transformers`` compiles chat templates in (same options and helpers)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled Hugging Face chat template and the special tokens it may reference.

    Compiling happens once, here: a syntax error raises :class:`TokenizerError` at start,
    not per request. Rendering is sandboxed and thread-safe.
    """

    def __init__(self, source: str, *, special_tokens: dict[str, str] | None = None) -> None:
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        try:
            self._template = _chat_environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(f"chat template: syntax error line {exc.lineno}: {exc}") from exc

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The conversation as text, generation prompt added (``add_generation_prompt``).

        Raises :class:`TokenizerError` when the template rejects the conversation
        (``raise_exception``) or fails on it.
        """
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=True,
                tools=None,
                documents=None,
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template rejected the messages: {exc}") from exc
        except Exception as exc:  # a template may fail on any input (KeyError, TypeError, ...)
            raise TokenizerError(f"chat template failed on the messages: {exc!r}") from exc


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{what} {path}: unreadable: {exc}") from exc


def _read_config(path: Path) -> dict[str, Any]:
    """A ``tokenizer_config.json`` as a dict; TokenizerError when unreadable or not an object."""
    try:
        config = json.loads(_read_text(path, "tokenizer config"))
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"tokenizer config {path}: invalid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise TokenizerError(f"tokenizer config {path}: expected a JSON object")
    return config


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """``bos_token``/``eos_token`` of a config; HF stores each as a string or an AddedToken."""
    found: dict[str, str] = {}
    for name in _SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            found[name] = value
    return found


def _config_template(config: dict[str, Any], path: Path) -> str | None:
    """The config's ``chat_template``: a string, or HF's named list (its ``default`` entry)."""
    source = config.get("chat_template")
    if source is None or isinstance(source, str):
        return source
    if isinstance(source, list):
        for entry in source:
            if isinstance(entry, dict) and entry.get("name") == "default":
                template = entry.get("template")
                if isinstance(template, str):
                    return template
        return None
    raise TokenizerError(f"tokenizer config {path}: chat_template must be a string or a list")


def load_chat_template(
    tokenizer_path: Path, chat_template_path: Path | None = None
) -> ChatTemplate | None:
    """The chat template of a model directory laid out like Hugging Face's.

    Source, first found: ``chat_template_path`` (a ``.json`` is read as a tokenizer config,
    anything else as Jinja2 text); else ``chat_template.jinja`` beside ``tokenizer_path``;
    else the ``chat_template`` of ``tokenizer_config.json`` beside it. Special tokens come
    from that config (or from ``chat_template_path`` when it is one). None when nothing
    was given and there is no template; TokenizerError when a file cannot be used.
    """
    config_path = tokenizer_path.parent / _TOKENIZER_CONFIG_FILE
    jinja_path: Path | None = tokenizer_path.parent / _CHAT_TEMPLATE_FILE
    if chat_template_path is not None:
        if not chat_template_path.is_file():
            raise TokenizerError(f"chat template {chat_template_path}: no such file")
        if chat_template_path.suffix == ".json":
            config_path, jinja_path = chat_template_path, None
        else:
            jinja_path = chat_template_path
    config = _read_config(config_path) if config_path.is_file() else {}
    if jinja_path is not None and jinja_path.is_file():
        source: str | None = _read_text(jinja_path, "chat template")
    else:
        source = _config_template(config, config_path)
    if source is None and chat_template_path is not None:
        raise TokenizerError(f"chat template {chat_template_path}: has no chat_template")
    return None if source is None else ChatTemplate(source, special_tokens=_special_tokens(config))


# --- local tokenizer --------------------------------------------------------------------


def _encode_one(tokenizer: tokenizers.Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def _encode_off_loop(
    tokenizer: tokenizers.Tokenizer, text: str, add_special_tokens: bool
) -> list[int]:
    # encode_batch releases the GIL while it works (encode does not), so the loop keeps running.
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


class LocalTokenizer:
    """Tokenizes in-process with a ``tokenizers.Tokenizer`` and an optional chat template.

    Texts up to ``inline_max_chars`` characters are encoded synchronously on the event
    loop (≤ ~1 ms); longer ones with :func:`asyncio.to_thread` through ``encode_batch``,
    which releases the GIL (an ~8k-token text takes 10-20 ms, too long to block the loop).
    Safe to call concurrently. Without a chat template, :meth:`encode_messages` raises
    :class:`TokenizerError` and :meth:`encode_prompt` still works.

    Messages are passed to the template as given (like ``apply_chat_template``); vLLM may
    normalise content parts first, so for exact engine parity prefer :class:`ReplicaTokenizer`.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: ChatTemplate | None = None,
        *,
        inline_max_chars: int = INLINE_MAX_CHARS,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.inline_max_chars = inline_max_chars

    @classmethod
    def from_files(cls, path: str | Path, chat_template_path: str | Path | None = None) -> Self:
        """Load ``tokenizer.json`` and the chat template (see :func:`load_chat_template`)."""
        path = Path(path)
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust binding raises a bare Exception
            raise TokenizerError(f"tokenizer file {path}: unreadable: {exc}") from exc
        template_path = None if chat_template_path is None else Path(chat_template_path)
        return cls(tokenizer, load_chat_template(path, template_path))

    async def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of ``prompt`` with the post-processor's special tokens (e.g. BOS)."""
        return await self._encode(prompt, add_special_tokens=True)

    async def encode_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the rendered conversation; no special tokens added on top of it."""
        if self.chat_template is None:
            raise TokenizerError("no chat template for this model: messages cannot be encoded")
        return await self._encode(self.chat_template.render(messages), add_special_tokens=False)

    async def _encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        try:
            if len(text) <= self.inline_max_chars:
                return _encode_one(self.tokenizer, text, add_special_tokens)
            return await asyncio.to_thread(
                _encode_off_loop, self.tokenizer, text, add_special_tokens
            )
        except Exception as exc:  # the Rust binding raises a bare Exception
            raise TokenizerError(f"tokenizer failed: {exc}") from exc


# --- replica tokenizer ------------------------------------------------------------------

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]


class _TokenizeResponse(msgspec.Struct):
    """The part of vLLM's ``/tokenize`` response we rely on (other fields are ignored)."""

    tokens: list[TokenId]


def _excerpt(text: str) -> str:
    """A short one-line excerpt of a response body, for error messages."""
    flat = " ".join(text.split())
    return flat if len(flat) <= _EXCERPT_CHARS else flat[:_EXCERPT_CHARS] + "…"


class ReplicaTokenizer:
    """Tokenizes through a vLLM replica's ``POST {base_url}/tokenize``.

    ``base_url`` is the server root (``http://host:8000``, not ``…/v1``). The caller owns
    ``client`` (connection pooling, closing). Each call makes one request bounded by
    ``timeout_s``; unreachable replicas, timeouts, HTTP error statuses and malformed
    responses raise :class:`TokenizerError`. Safe to call concurrently.
    """

    def __init__(
        self, client: httpx.AsyncClient, base_url: str, model: str, *, timeout_s: float = 5.0
    ) -> None:
        self.client = client
        self.url = base_url.rstrip("/") + "/tokenize"
        self.model = model
        self.timeout_s = timeout_s

    async def encode_prompt(self, prompt: str) -> list[int]:
        """The replica's tokens for a completions prompt (``add_special_tokens`` true)."""
        body = {"model": self.model, "prompt": prompt, "add_special_tokens": True}
        return await self._tokenize(body)

    async def encode_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """The replica's tokens for the conversation, generation prompt added and
        ``add_special_tokens`` false (vLLM's chat defaults)."""
        body = {
            "model": self.model,
            "messages": messages,
            "add_generation_prompt": True,
            "add_special_tokens": False,
        }
        return await self._tokenize(body)

    async def _tokenize(self, body: dict[str, Any]) -> list[int]:
        response = await self._post(body)
        if response.is_error:
            raise TokenizerError(
                f"{self.url}: HTTP {response.status_code}: {_excerpt(response.text)}"
            )
        try:
            return msgspec.json.decode(response.content, type=_TokenizeResponse).tokens
        except msgspec.DecodeError as exc:
            raise TokenizerError(
                f"{self.url}: malformed response ({exc}): {_excerpt(response.text)}"
            ) from exc

    async def _post(self, body: dict[str, Any]) -> httpx.Response:
        try:
            content = msgspec.json.encode(body)
        except (TypeError, ValueError) as exc:
            raise TokenizerError(f"{self.url}: request is not JSON-serializable: {exc}") from exc
        try:
            return await self.client.post(
                self.url, content=content, headers=_JSON_HEADERS, timeout=self.timeout_s
            )
        except httpx.TimeoutException as exc:
            raise TokenizerError(f"{self.url}: timed out after {self.timeout_s} s") from exc
        except httpx.RequestError as exc:
            raise TokenizerError(f"{self.url}: unreachable: {exc!r}") from exc


# --- cache ------------------------------------------------------------------------------

_Packed: TypeAlias = "array[int]"  # token ids as u32: 4 bytes each, a list needs 8 + 28


def _pack(tokens: list[int]) -> _Packed:
    try:
        return array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise TokenizerError(f"token ids must be integers in [0, 2**32): {exc}") from exc


def messages_key(messages: list[dict[str, Any]]) -> bytes:
    """A canonical encoding of a conversation: JSON, object keys sorted, every message kept."""
    try:
        return msgspec.json.encode(messages, order="sorted")
    except (TypeError, ValueError) as exc:
        raise TokenizerError(f"messages are not JSON-serializable: {exc}") from exc


class CachingTokenizer:
    """An LRU cache of at most ``max_entries`` tokenizations in front of another Tokenizer.

    Keys are the exact prompt text, or :func:`messages_key` of the conversation (a ``str``
    and a ``bytes`` key never compare equal, so prompts and conversations never collide).
    Concurrent identical misses share one call to ``inner`` (in flight, shielded from a
    caller's cancellation); only the call that starts it counts as a miss, the others as
    hits. Errors are not cached. Token ids are stored as u32 (4 bytes per token).

    ``num_hits`` and ``num_misses`` count calls answered without / by calling ``inner``.
    Use from one event loop at a time (asyncio, no threads).
    """

    def __init__(self, inner: Tokenizer, max_entries: int = 4096) -> None:
        if max_entries < 1:
            raise TokenizerError(f"max_entries must be >= 1, got {max_entries}")
        self.inner = inner
        self.max_entries = max_entries
        self.num_hits = 0
        self.num_misses = 0
        self._entries: OrderedDict[str | bytes, _Packed] = OrderedDict()
        self._in_flight: dict[str | bytes, asyncio.Task[_Packed]] = {}

    def __len__(self) -> int:
        """Number of cached tokenizations."""
        return len(self._entries)

    async def encode_prompt(self, prompt: str) -> list[int]:
        """``inner.encode_prompt(prompt)``, cached by the exact text."""
        return await self._cached(prompt, lambda: self.inner.encode_prompt(prompt))

    async def encode_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """``inner.encode_messages(messages)``, cached by :func:`messages_key`."""
        key = messages_key(messages)
        return await self._cached(key, lambda: self.inner.encode_messages(messages))

    async def _cached(
        self, key: str | bytes, compute: Callable[[], Awaitable[list[int]]]
    ) -> list[int]:
        packed = self._entries.get(key)
        if packed is not None:
            self._entries.move_to_end(key)
            self.num_hits += 1
            return packed.tolist()
        task = self._in_flight.get(key)
        if task is None:
            self.num_misses += 1
            task = asyncio.create_task(self._fill(key, compute))
            self._in_flight[key] = task
            task.add_done_callback(lambda _: self._in_flight.pop(key, None))
        else:
            self.num_hits += 1
        return (await asyncio.shield(task)).tolist()

    async def _fill(self, key: str | bytes, compute: Callable[[], Awaitable[list[int]]]) -> _Packed:
        packed = _pack(await compute())
        self._entries[key] = packed
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return packed


# --- assembly ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """How to tokenize one model's requests. Validated on construction (errors name the field)."""

    kind: TokenizerKind
    """``local`` (a tokenizer.json in-process) or ``replica`` (the replica's ``/tokenize``)."""
    path: str | None = None
    """local: path of the ``tokenizer.json``."""
    chat_template_path: str | None = None
    """local: a Jinja2 chat template or a ``tokenizer_config.json`` (default: beside ``path``)."""
    base_url: str | None = None
    """replica: the vLLM server root, ``http://host:port``."""
    model: str | None = None
    """replica: the model name as served (the request's ``model``)."""
    timeout_s: float = 5.0
    """replica: timeout of one ``/tokenize`` request, in seconds."""
    cache_entries: int = 4096
    """Tokenizations kept in the LRU cache; 0 disables caching."""

    def __post_init__(self) -> None:
        if self.kind not in get_args(TokenizerKind):
            raise TokenizerError(
                f"kind must be one of {get_args(TokenizerKind)}, got {self.kind!r}"
            )
        if self.cache_entries < 0:
            raise TokenizerError(f"cache_entries must be >= 0, got {self.cache_entries!r}")
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
        _forbid(self, ("path", "chat_template_path"), "replica")


def _forbid(spec: TokenizerSpec, names: tuple[str, ...], kind: str) -> None:
    """A field set for the other kind is a configuration mistake worth reporting."""
    for name in names:
        if getattr(spec, name) is not None:
            raise TokenizerError(f"{name} is not used when kind is {kind!r}; remove it")


def build_tokenizer(spec: TokenizerSpec, client: httpx.AsyncClient) -> Tokenizer:
    """The Tokenizer a spec describes, cached unless ``cache_entries`` is 0.

    ``client`` is used only by ``replica`` tokenizers; the caller keeps owning it. Loading a
    local tokenizer reads its files now and raises :class:`TokenizerError` if they are bad.
    """
    inner: Tokenizer
    if spec.kind == "local":
        assert spec.path is not None  # checked by TokenizerSpec
        inner = LocalTokenizer.from_files(spec.path, spec.chat_template_path)
    else:
        assert spec.base_url is not None and spec.model is not None  # checked by TokenizerSpec
        inner = ReplicaTokenizer(client, spec.base_url, spec.model, timeout_s=spec.timeout_s)
    if spec.cache_entries == 0:
        return inner
    return CachingTokenizer(inner, spec.cache_entries)
