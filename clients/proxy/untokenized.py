"""A request routed without its prompt's tokens says so: :data:`UNTOKENIZED` among its answer's
headers, and one warning a model per :data:`LOG_WINDOW_S`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

TOKENIZER_HEADER = "x-kvindex-tokenizer"
"""Set to ``failed`` on an answer whose replica was chosen without the prompt's tokens."""
LOG_WINDOW_S = 10.0
UNTOKENIZED = (TOKENIZER_HEADER.encode(), b"failed")


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
