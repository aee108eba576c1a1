"""A request routed without its prompt's tokens says so: ``x-kvindex-tokenizer: failed`` on its
answer (marked by :func:`mark_untokenized`), one warning a model per :data:`LOG_WINDOW_S`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

TOKENIZER_HEADER = "x-kvindex-tokenizer"
"""Set to ``failed`` on an answer whose replica was chosen without the prompt's tokens."""
LOG_WINDOW_S = 10.0
_FAILED = (TOKENIZER_HEADER.encode(), b"failed")
_note: ContextVar[list[bool] | None] = ContextVar("kvindex_untokenized", default=None)


def mark_untokenized() -> None:
    """Mark the current request as routed without tokens (outside a request: nothing)."""
    note = _note.get()
    if note is not None:
        note.append(True)


class UntokenizedHeader:
    """ASGI wrapper: an HTTP answer of a request marked by :func:`mark_untokenized` gets
    ``x-kvindex-tokenizer: failed`` among its headers; anything else passes untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        note: list[bool] = []
        _note.set(note)

        async def send_marked(message: Message) -> None:
            if note and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), _FAILED]}
            await send(message)

        await self.app(scope, receive, send_marked)


class FailureLog:
    """Logs a model's tokenizer failure as a warning at most once per ``window_s``; the next
    line says how many were held back. One event loop."""

    def __init__(
        self,
        logger: logging.Logger,
        window_s: float = LOG_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._window_s = window_s
        self._clock = clock
        self._model_to_last: dict[str, tuple[float, int]] = {}
        """Per model: when a line was last logged, failures held back since."""

    def failed(self, model: str, reason: str) -> None:
        now = self._clock()
        last, held = self._model_to_last.get(model, (-self._window_s, 0))
        if now - last < self._window_s:
            self._model_to_last[model] = (last, held + 1)
            return
        self._model_to_last[model] = (now, 0)
        more = f" [{held} more since]" if held else ""
        self._logger.warning(
            "tokenizer of %s failed; routed on load alone: %s%s", model, reason, more
        )
