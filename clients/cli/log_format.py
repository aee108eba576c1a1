"""How a ``kvindex`` process logs: text or JSON lines on stderr, repeated warnings held back.

:func:`configure_logging` (called once by the CLI group, before any command) installs one
handler on the root logger:

- ``text``: ``2026-12-01 21:50:17,123 WARNING kvindex.fleet: message``;
- ``json``: one object per line, ``{"ts", "level", "logger", "message", ...}``, the record's
  extra fields (``logger.info(..., extra={...})``: the access log's ``route``, ``status``,
  ``duration_ms``) as further keys, and ``exc`` with the traceback when there is one.

Warnings and errors of the ``kvindex`` loggers (the API's and the indexer's) pass a
:class:`RepeatFilter`: the same logger and message template at most once per window (a
store that is down is otherwise reported every time it is read), and the next one let
through says how many were held back.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
HANDLER_NAME = "kvindex"
"""The name of the handler :func:`configure_logging` installs (a second call replaces it)."""

_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "color_message",  # uvicorn's copy of the message with terminal colours
}
"""Attributes every LogRecord has (and uvicorn's coloured copy): what is not among them
came as ``extra``."""


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines inside values are escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and not key.startswith("_"):
                body[key] = value
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            body["stack"] = self.formatStack(record.stack_info)
        return json.dumps(body, default=str)


@dataclass(slots=True)
class _Seen:
    last_passed: float
    num_suppressed: int = 0


class RepeatFilter(logging.Filter):
    """Lets through a record at ``min_level`` or above of a logger under ``prefix`` only if
    the same logger and message template (the format string, not the formatted text: the
    same warning about another replica is the same warning; the text when the format
    string is only placeholders) has not passed in the last
    ``window_s``. A record let through after others were held back gets ``num_suppressed``
    (an extra field) and its message says how many and over how long. Lower levels and
    other loggers always pass. Thread-safe."""

    def __init__(
        self,
        window_s: float,
        *,
        prefix: str = "kvindex",
        min_level: int = logging.WARNING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._window_s = window_s
        self._prefix = prefix
        self._min_level = min_level
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], _Seen] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self._min_level or not _under(record.name, self._prefix):
            return True
        key = (record.name, _template_of(record))
        now = self._clock()
        with self._lock:
            seen = self._seen.get(key)
            if seen is not None and now - seen.last_passed < self._window_s:
                seen.num_suppressed += 1
                return False
            held_back = seen.num_suppressed if seen is not None else 0
            since = now - seen.last_passed if seen is not None else 0.0
            self._seen[key] = _Seen(now)
        if held_back:
            record.num_suppressed = held_back
            record.msg = f"{record.msg} [{held_back} more like this held back in {since:.0f} s]"
        return True


_PLACEHOLDER = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[a-zA-Z%]")


def _template_of(record: logging.LogRecord) -> str:
    """What makes two records the same warning: the format string, or the formatted text
    when the format string says nothing of its own (``log.warning("%s", why)``)."""
    template = str(record.msg)
    if not _PLACEHOLDER.sub("", template).strip():
        return record.getMessage()
    return template


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


class _StderrHandler(logging.StreamHandler[TextIO]):
    """Writes to whatever ``sys.stderr`` is at the time (as ``logging.lastResort`` does),
    so a process that swaps it (a test runner) never logs into a closed stream."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


def configure_logging(*, level: int, log_format: LogFormat, repeat_window_s: float) -> None:
    """The root logger at ``level`` with one stderr handler in ``log_format``, repeated
    ``kvindex`` warnings held back for ``repeat_window_s`` (0: never). Replaces the handler
    a previous call installed; leaves any other handler alone."""
    handler = _StderrHandler()
    handler.set_name(HANDLER_NAME)
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    handler.setFormatter(formatter)
    if repeat_window_s > 0:
        handler.addFilter(RepeatFilter(repeat_window_s))
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
