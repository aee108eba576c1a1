"""How a ``kvindex`` process logs: text or JSON lines on stderr, repeated warnings held back.

One handler on the root logger: ``text`` lines, or one JSON object per line with the record's
extra fields as keys. Warnings of the ``kvindex`` loggers pass a :class:`RepeatFilter`. The
log options are taken before the command and after it (the command's win)."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

import click

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
HANDLER_NAME = "kvindex"

_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "color_message",  # uvicorn's copy of the message with terminal colours
}


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
    """Lets a ``kvindex`` warning through at most once per ``window_s`` for one logger and
    message, its arguments included ("r2 ejected" is not a repeat of "r1 ejected"); the
    next one says how many were held back. Thread-safe; remembers at most ``max_keys``
    messages (the oldest forgotten first)."""

    def __init__(
        self,
        window_s: float,
        *,
        prefix: str = "kvindex",
        min_level: int = logging.WARNING,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 4096,
    ) -> None:
        super().__init__()
        self._window_s = window_s
        self._prefix = prefix
        self._min_level = min_level
        self._clock = clock
        self._max_keys = max_keys
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], _Seen] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self._min_level or not _under(record.name, self._prefix):
            return True
        key = (record.name, record.getMessage())
        now = self._clock()
        with self._lock:
            seen = self._seen.pop(key, None)  # put back last: the dict is oldest first
            if seen is not None and now - seen.last_passed < self._window_s:
                seen.num_suppressed += 1
                self._seen[key] = seen
                return False
            held_back = seen.num_suppressed if seen is not None else 0
            since = now - seen.last_passed if seen is not None else 0.0
            self._seen[key] = _Seen(now)
            while len(self._seen) > self._max_keys:
                del self._seen[next(iter(self._seen))]
        if held_back:
            record.num_suppressed = held_back
            record.msg = f"{record.msg} [{held_back} more like this held back in {since:.0f} s]"
        return True


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


class _StderrHandler(logging.StreamHandler[TextIO]):
    """Writes to whatever ``sys.stderr`` is at the time, as ``logging.lastResort`` does."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


def configure_logging(*, level: int, log_format: LogFormat, repeat_window_s: float) -> None:
    """The root logger at ``level`` with one stderr handler in ``log_format`` (replacing the
    one a previous call installed); repeated warnings held back for ``repeat_window_s``."""
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


# --- the log options of the command line -----------------------------------------------------

_GIVEN = "kvindex.log_options"
"""Key, in the context's ``meta`` (shared by the group and its command), of the options given."""


def _remember(ctx: click.Context, param: click.Parameter, value: object) -> None:
    if value is None or value is False or param.name is None:
        return
    ctx.meta.setdefault(_GIVEN, {})[param.name] = value
    if ctx.parent is not None:  # a command's own option: parsed after the group's took effect
        apply_log_options(ctx)


def apply_log_options(ctx: click.Context) -> None:
    """Configure logging from the log options given so far (the command's over the group's)."""
    given = ctx.meta.get(_GIVEN, {})
    level = given.get("log_level") or ("debug" if given.get("verbose") else "info")
    configure_logging(
        level=logging.getLevelName(level.upper()),
        log_format=given.get("log_format", "text"),
        repeat_window_s=given.get("log_repeat_s", 10.0),
    )
    if level != "debug":  # httpx logs one line per request (the /metrics scraper: several a second)
        logging.getLogger("httpx").setLevel(logging.WARNING)


def log_options(*, group: bool) -> list[click.Option]:
    """``--log-format`` and ``--log-level`` (the group's: with their environment variables
    and defaults, ``-v`` and ``--log-repeat-s`` too)."""
    common: dict[str, Any] = {"expose_value": False, "callback": _remember}
    where = "" if group else " (also before the command)"
    options = [
        click.Option(
            ["--log-format"],
            type=click.Choice(LOG_FORMATS),
            envvar="KVINDEX_LOG_FORMAT" if group else None,
            help=f"Log lines on stderr: text, or one JSON object per line{where}"
            + (" [env KVINDEX_LOG_FORMAT; default: text]" if group else ""),
            **common,
        ),
        click.Option(
            ["--log-level"],
            type=click.Choice(LOG_LEVELS, case_sensitive=False),
            envvar="KVINDEX_LOG_LEVEL" if group else None,
            help=f"Least level logged{where}"
            + (" [env KVINDEX_LOG_LEVEL; default: info, debug with -v]" if group else ""),
            **common,
        ),
    ]
    if not group:
        return options
    verbose = click.Option(["-v", "--verbose"], is_flag=True, help="Log at debug level.", **common)
    repeat = click.Option(
        ["--log-repeat-s"],
        type=click.FloatRange(min=0),
        default=10.0,
        show_default=True,
        envvar="KVINDEX_LOG_REPEAT_S",
        help="Log the same kvindex warning at most once per this many seconds, then say how"
        " many were held back (0: log every one).",
        **common,
    )
    return [verbose, *options, repeat]


def add_log_options(group: click.Group) -> None:
    """Give every command of ``group`` its own ``--log-format`` and ``--log-level``."""
    for command in group.commands.values():
        command.params.extend(log_options(group=False))
