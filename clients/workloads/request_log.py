"""A log of OpenAI API request bodies (JSONL, plain or gzip), read line by line and tokenized
as the engine would (:class:`LogTokenizer`); bad lines are reported (:class:`LogProblem`)."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import math
from collections.abc import AsyncGenerator, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import msgspec

from kvindex.api.tokenize.chat_template import ChatTemplate
from kvindex.api.tokenize.local import LocalTokenizer
from kvindex.api.tokenize.protocol import (
    NO_OPTIONS,
    ChatOptions,
    Tokenizer,
    TokenizerError,
    chat_options_of,
)
from kvindex.api.tokenize.replica import ReplicaTokenizer
from kvindex.indexer.domain.errors import KvIndexError

TIMESTAMP_FIELDS = ("timestamp", "created", "time", "arrival_time")
"""Where a line's arrival time is looked for, first found (beside ``body``, then in it)."""
MS_EPOCH_ABOVE = 1e11
"""A numeric timestamp above this is in milliseconds (1e11 s is the year 5138)."""
DEFAULT_MODEL = "default"
"""The model of a request that names none (block keys are rooted at the model's name)."""
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "<|assistant|>{{ '\\n' }}"  # Jinja drops a template's final newline: written as an expression
)
"""Without a chat template: ``<|role|>``, newline, text, newline per message; ``<|assistant|>``."""
TOKENIZE_CONCURRENCY = 16
"""Requests tokenized at once (a replica's ``/tokenize`` answers several in parallel)."""


class RequestLogError(KvIndexError):
    """The log or the tokenizer cannot be used at all (a missing file, a bad tokenizer)."""


@dataclass(frozen=True, slots=True)
class LoggedRequest:
    """One request of the log, as read (not yet tokenized)."""

    line: int
    model: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    timestamp_s: float | None = None
    max_tokens: int | None = None
    user: str | None = None
    chat_options: ChatOptions = NO_OPTIONS
    """What else of a chat its template renders (tools, ...)."""

    def conversation(self) -> str:
        """``user`` if given, else a digest of the chat's first two messages, else of the line."""
        if self.user:
            return f"user:{self.user}"
        if self.messages:
            head = msgspec.json.encode(self.messages[:2])
            return "chat:" + hashlib.blake2b(head, digest_size=8).hexdigest()
        return f"line:{self.line}"


@dataclass(frozen=True, slots=True)
class LogProblem:
    """A line that was skipped, and why."""

    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


@dataclass(frozen=True, slots=True)
class TokenizedRequest:
    request: LoggedRequest
    tokens: list[int]


@dataclass(slots=True)
class Problems:
    """Problems met while reading, kept up to ``keep`` (all are counted)."""

    keep: int = 20
    count: int = 0
    kept: list[LogProblem] = field(default_factory=list)

    def add(self, problem: LogProblem) -> None:
        self.count += 1
        if len(self.kept) < self.keep:
            self.kept.append(problem)


# --- reading ---------------------------------------------------------------------------------


class BadLineError(RequestLogError):
    """A line that is not a request (the reader turns it into a :class:`LogProblem`)."""


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    try:
        with path.open("rb") as probe:
            gzipped = probe.read(2) == b"\x1f\x8b"
        with gzip.open(path, "rb") if gzipped else path.open("rb") as lines:
            for lineno, line in enumerate(lines, 1):
                if line.strip():
                    yield lineno, line
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
        raise RequestLogError(f"{path}: {exc}") from exc


def read_request_log(path: Path, problems: Problems) -> Iterator[LoggedRequest]:
    """The requests of the log at ``path``, in order; bad lines go to ``problems``."""
    if not path.is_file():
        raise RequestLogError(f"{path}: no such file")
    for lineno, line in _lines(path):
        try:
            yield parse_line(lineno, line)
        except BadLineError as exc:
            problems.add(LogProblem(lineno, str(exc)))


def parse_line(lineno: int, line: bytes | str) -> LoggedRequest:
    """One line as a request; raises :class:`BadLineError` saying what is wrong."""
    try:
        row = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        raise BadLineError(f"not JSON: {exc}") from exc
    if not isinstance(row, dict):
        raise BadLineError("not a JSON object")
    body = row.get("body", row)
    if not isinstance(body, dict):
        raise BadLineError("'body' is not a JSON object")
    model = body.get("model", DEFAULT_MODEL)
    if not isinstance(model, str) or not model:
        raise BadLineError("'model' is not a non-empty string")
    return LoggedRequest(
        line=lineno,
        model=model,
        **_prompt_fields(body),
        timestamp_s=_timestamp(row, body),
        max_tokens=_max_tokens(body),
        user=body.get("user") if isinstance(body.get("user"), str) else None,
    )


def _prompt_fields(body: dict[str, Any]) -> dict[str, Any]:
    messages, prompt = body.get("messages"), body.get("prompt")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise BadLineError("'messages' is not a non-empty list")
        return {"messages": [_message(m) for m in messages], "chat_options": chat_options_of(body)}
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        return {"prompt_ids": prompt}
    if prompt is None:
        raise BadLineError("neither 'messages' nor 'prompt'")
    raise BadLineError("'prompt' is not a string or a list of token ids")


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def _message(message: object) -> dict[str, Any]:
    """A message with its content as text (text parts joined; other parts left out)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadLineError("a message is not an object with a 'role'")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return {**message, "content": content or ""}
    if isinstance(content, list):
        texts = [
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        ]
        return {**message, "content": "\n".join(texts)}
    raise BadLineError("a message's 'content' is not text or a list of parts")


def _timestamp(row: dict[str, Any], body: dict[str, Any]) -> float | None:
    for where in (row, body):
        for name in TIMESTAMP_FIELDS:
            if name in where:
                return _seconds(name, where[name])
    return None


def _seconds(name: str, value: object) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return value / 1000.0 if value > MS_EPOCH_ABOVE else float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    raise BadLineError(f"{name!r} is not a number of seconds or an ISO-8601 time: {value!r}")


def _max_tokens(body: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


# --- tokenizing ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenizerOptions:
    """``--tokenizer`` / ``--chat-template`` or ``--tokenizer-url`` (exactly one source)."""

    path: Path | None = None
    chat_template_path: Path | None = None
    url: str | None = None
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if (self.path is None) == (self.url is None):
            raise RequestLogError("give exactly one of --tokenizer FILE or --tokenizer-url URL")
        if self.url is not None and self.chat_template_path is not None:
            raise RequestLogError("--chat-template applies to --tokenizer, not --tokenizer-url")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise RequestLogError(f"--tokenizer-url must be an http(s):// URL, got {self.url!r}")


class LogTokenizer:
    """Token ids of logged requests and text of token ids, by one source; a context manager."""

    def __init__(self, options: TokenizerOptions, client: httpx.AsyncClient | None = None) -> None:
        self.options = options
        self._owns_client = client is None
        self._client = client if client is not None else httpx.AsyncClient()
        self._local: LocalTokenizer | None = None
        self._model_to_replica: dict[str, ReplicaTokenizer] = {}
        if options.path is not None:
            self._local = _local_tokenizer(options.path, options.chat_template_path)

    async def __aenter__(self) -> LogTokenizer:
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._owns_client:
            await self._client.aclose()

    @property
    def local(self) -> LocalTokenizer | None:
        """The in-process tokenizer; None with ``--tokenizer-url``."""
        return self._local

    def _tokenizer(self, model: str) -> Tokenizer:
        if self._local is not None:
            return self._local
        replica = self._model_to_replica.get(model)
        if replica is None:
            assert self.options.url is not None  # checked by TokenizerOptions
            replica = ReplicaTokenizer(
                self._client, self.options.url, model, timeout_s=self.options.timeout_s
            )
            self._model_to_replica[model] = replica
        return replica

    async def tokens(self, request: LoggedRequest) -> list[int]:
        """The prompt's token ids as the engine sees them; raises TokenizerError."""
        if request.prompt_ids is not None:
            return list(request.prompt_ids)
        tokenizer = self._tokenizer(request.model)
        if request.messages is not None:
            return await tokenizer.encode_messages(request.messages, request.chat_options)
        assert request.prompt is not None  # a LoggedRequest has one of the three
        return await tokenizer.encode_prompt(request.prompt)

    async def decode(self, model: str, token_ids: list[int]) -> str:
        """Text of ``token_ids`` (the ids themselves when the source cannot say)."""
        if self._local is not None:
            return self._local.tokenizer.decode(token_ids, skip_special_tokens=False)
        assert self.options.url is not None
        url = self.options.url.rstrip("/") + "/detokenize"
        try:
            answer = await self._client.post(
                url, json={"model": model, "tokens": token_ids}, timeout=self.options.timeout_s
            )
            text = answer.json().get("prompt") if answer.is_success else None
        except (httpx.HTTPError, ValueError, AttributeError):
            text = None
        return text if isinstance(text, str) else f"token ids {token_ids}"


def _local_tokenizer(path: Path, chat_template_path: Path | None) -> LocalTokenizer:
    try:
        local = LocalTokenizer.from_files(path, chat_template_path)
    except TokenizerError as exc:
        raise RequestLogError(str(exc)) from exc
    if local.chat_template is None:
        local.chat_template = ChatTemplate(DEFAULT_CHAT_TEMPLATE)
    return local


async def tokenized(
    requests: Iterator[LoggedRequest], tokenizer: LogTokenizer, problems: Problems
) -> AsyncGenerator[TokenizedRequest]:
    """``requests`` with their token ids, in order; the ones that cannot be go to ``problems``."""
    batch: list[LoggedRequest] = []
    for request in requests:
        batch.append(request)
        if len(batch) >= TOKENIZE_CONCURRENCY:
            for done in await _tokenize_batch(batch, tokenizer, problems):
                yield done
            batch = []
    for done in await _tokenize_batch(batch, tokenizer, problems):
        yield done


async def _tokenize_batch(
    batch: list[LoggedRequest], tokenizer: LogTokenizer, problems: Problems
) -> list[TokenizedRequest]:
    answers = await asyncio.gather(*(tokenizer.tokens(r) for r in batch), return_exceptions=True)
    return accepted_requests(batch, answers, problems)


def accepted_requests(
    batch: Sequence[LoggedRequest],
    answers: Sequence[list[int] | BaseException],
    problems: Problems,
) -> list[TokenizedRequest]:
    """The requests of ``batch`` whose answer is a non-empty list of token ids."""
    out: list[TokenizedRequest] = []
    for request, answer in zip(batch, answers, strict=True):
        if isinstance(answer, TokenizerError):
            problems.add(LogProblem(request.line, f"cannot tokenize: {answer}"))
        elif isinstance(answer, BaseException):
            raise answer
        elif not answer:
            problems.add(LogProblem(request.line, "the prompt has no tokens"))
        else:
            out.append(TokenizedRequest(request, answer))
    return out


async def read_tokenized_log(
    path: Path,
    options: TokenizerOptions,
    *,
    limit: int | None = None,
    client: httpx.AsyncClient | None = None,
) -> tuple[list[TokenizedRequest], Problems]:
    """Every request of the log with its token ids (at most ``limit``), and the problems met."""
    problems = Problems()
    out: list[TokenizedRequest] = []
    async with LogTokenizer(options, client) as tokenizer:
        stream = tokenized(read_request_log(path, problems), tokenizer, problems)
        async with aclosing(stream):
            async for done in stream:
                out.append(done)
                if limit is not None and len(out) >= limit:
                    break
    return out, problems
