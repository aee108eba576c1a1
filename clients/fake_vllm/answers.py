"""What a replica-sim answers, in vLLM's OpenAI shapes: completions and chat completions,
their ``usage`` (with the prefix-cache hit as ``--enable-prompt-tokens-details`` reports it),
and a finished answer as a stream's chunks, each with ``kvsim`` (the simulated timings); all
made from a :class:`SimResult`, one finished request."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

_json = msgspec.json.encode


class AnswerSettings(Protocol):
    """What an answer reads of a replica's settings (``ReplicaSimSettings``)."""

    @property
    def id(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def enable_prompt_tokens_details(self) -> bool: ...


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    """True: a last chunk (no choices) carries the ``usage`` (else no chunk does)."""


@dataclass(frozen=True, slots=True)
class SimResult:
    """One finished request; times in simulated seconds."""

    output: list[str]
    output_tokens: list[int]
    cached_tokens: int
    queue_s: float
    prefill_s: float
    decode_s: float

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.prefill_s

    @property
    def latency_s(self) -> float:
        return self.ttft_s + self.decode_s


def completion_response(settings: AnswerSettings, prompt_len: int, result: SimResult) -> Any:
    """OpenAI completions shape, plus ``kvsim`` (simulated timings)."""
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": settings.model,
        "choices": [
            {
                "index": 0,
                "text": " " + " ".join(result.output),
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": usage(settings, prompt_len, result),
        "kvsim": {
            "replica": settings.id,
            "cached_tokens": result.cached_tokens,
            "queue_s": result.queue_s,
            "ttft_s": result.ttft_s,
            "latency_s": result.latency_s,
        },
    }


def usage(settings: AnswerSettings, prompt_len: int, result: SimResult) -> dict[str, Any]:
    """vLLM's ``usage``: token counts, and with ``enable_prompt_tokens_details`` the prompt
    tokens the engine found in its prefix cache (whole blocks, the last prompt token never)."""
    num_output = len(result.output_tokens)
    out: dict[str, Any] = {
        "prompt_tokens": prompt_len,
        "completion_tokens": num_output,
        "total_tokens": prompt_len + num_output,
    }
    if settings.enable_prompt_tokens_details:
        out["prompt_tokens_details"] = {"cached_tokens": result.cached_tokens}
    return out


def chat_response(settings: AnswerSettings, prompt_len: int, result: SimResult) -> Any:
    """OpenAI chat completions shape: :func:`completion_response` with a message."""
    answer = completion_response(settings, prompt_len, result)
    text = answer["choices"][0].pop("text")
    answer["id"] = f"chatcmpl-{uuid.uuid4().hex}"
    answer["object"] = "chat.completion"
    answer["choices"][0]["message"] = {"role": "assistant", "content": text}
    return answer


def sse_chunks(answer: Any, *, chat: bool, include_usage: bool = False) -> list[bytes]:
    """A finished answer as OpenAI server-sent events: a chunk per word, then, as vLLM when
    ``stream_options.include_usage`` is true, one without choices carrying ``usage``."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {k: answer[k] for k in ("id", "created", "model")} | {"object": kind}
    text = answer["choices"][0]["message"]["content"] if chat else answer["choices"][0]["text"]
    words = text.split(" ")[1:]
    events = []
    for i, word in enumerate(words):
        piece = " " + word
        last = i == len(words) - 1
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
        if chat:
            choice["delta"] = (
                {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
            )
        else:
            choice |= {"text": piece, "logprobs": None}
        events.append(head | {"choices": [choice]})
    if include_usage:
        events.append(head | {"choices": [], "usage": answer["usage"], "kvsim": answer["kvsim"]})
    return [b"data: " + _json(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]
