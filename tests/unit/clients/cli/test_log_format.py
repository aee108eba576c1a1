"""kvindex.clients.cli.log_format: JSON lines, the repeat filter, the installed handler."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator

import pytest

from kvindex.clients.cli.log_format import (
    HANDLER_NAME,
    JsonFormatter,
    RepeatFilter,
    configure_logging,
)


def record(
    msg: str, *args: object, name: str = "kvindex.fleet", level: int = logging.WARNING
) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_a_json_line_has_ts_level_logger_message_and_the_extra_fields() -> None:
    entry = record("GET %s %d", "/score", 200, name="kvindex.access", level=logging.INFO)
    entry.route = "/score"
    entry.duration_ms = 1.25
    line = JsonFormatter().format(entry)
    assert "\n" not in line
    body = json.loads(line)
    assert body["ts"].endswith("+00:00") and "T" in body["ts"]
    assert (body["level"], body["logger"], body["message"]) == (
        "INFO",
        "kvindex.access",
        "GET /score 200",
    )
    assert (body["route"], body["duration_ms"]) == ("/score", 1.25)
    assert "args" not in body and "msg" not in body


def test_uvicorns_coloured_copy_of_the_message_is_left_out() -> None:
    entry = record("Started", name="uvicorn.error", level=logging.INFO)
    entry.color_message = "\x1b[1mStarted\x1b[0m"
    assert "color_message" not in json.loads(JsonFormatter().format(entry))


def test_a_json_line_carries_the_traceback() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        entry = logging.LogRecord("kvindex", logging.ERROR, __file__, 1, "failed", (), None)
        entry.exc_info = sys.exc_info()
    body = json.loads(JsonFormatter().format(entry))
    assert "ValueError: boom" in body["exc"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_repeated_warning_passes_once_per_window_then_says_how_many_were_held() -> None:
    clock = Clock()
    repeats = RepeatFilter(10.0, clock=clock)
    template = "fleet state unreadable, serving the last one: %s"
    passed = []
    for i in range(20):  # one every 0.7 s, as the fleet view warned while Redis was down
        clock.now = i * 0.7
        entry = record(template, "connection refused")
        if repeats.filter(entry):
            passed.append(entry)
    first, second = passed
    assert first.getMessage() == "fleet state unreadable, serving the last one: connection refused"
    assert second.getMessage().startswith(
        "fleet state unreadable, serving the last one: connection refused"
    )
    assert "[14 more like this held back in 10 s]" in second.getMessage()
    assert second.num_suppressed == 14  # type: ignore[attr-defined]


def test_the_same_template_with_other_arguments_is_another_message() -> None:
    repeats = RepeatFilter(10.0, clock=Clock())
    assert repeats.filter(record("replica %s ejected: %s", "r1", "breaker"))
    assert repeats.filter(record("replica %s ejected: %s", "r2", "breaker"))
    assert repeats.filter(record("replica %s ejected: %s", "r3", "breaker"))
    assert not repeats.filter(record("replica %s ejected: %s", "r2", "breaker"))


def test_other_templates_loggers_and_levels_are_not_held() -> None:
    repeats = RepeatFilter(10.0, clock=Clock())
    assert repeats.filter(record("one %s", 1))
    assert repeats.filter(record("another %s", 1))  # another template
    assert repeats.filter(record("one %s", 1, name="kvindex.store"))  # another logger
    assert repeats.filter(record("one %s", 1, name="httpx"))
    assert repeats.filter(record("one %s", 1, name="httpx"))  # not a kvindex logger
    assert repeats.filter(record("one %s", 1, level=logging.INFO))  # below WARNING
    assert not repeats.filter(record("one %s", 1))


def test_a_template_of_placeholders_only_is_told_apart_by_its_text() -> None:
    repeats = RepeatFilter(10.0, clock=Clock())
    assert repeats.filter(record("%s", "fleet state unreadable"))
    assert repeats.filter(record("%s", "fleet state lost by redis"))
    assert not repeats.filter(record("%s", "fleet state unreadable"))


def test_the_filter_remembers_a_bounded_number_of_messages() -> None:
    clock = Clock()
    repeats = RepeatFilter(10.0, clock=clock, max_keys=3)
    for name in ("a", "b", "c", "d"):  # "a", the oldest, is forgotten
        assert repeats.filter(record("stream %s silent", name))
    assert not repeats.filter(record("stream %s silent", "d"))
    assert repeats.filter(record("stream %s silent", "a"))


@pytest.fixture
def root_handlers() -> Iterator[None]:
    """Put the root logger back as it was after the test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("root_handlers")
def test_configure_installs_one_json_handler_with_the_filter(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging(level=logging.INFO, log_format="text", repeat_window_s=5.0)
    configure_logging(level=logging.INFO, log_format="json", repeat_window_s=5.0)
    ours = [h for h in logging.getLogger().handlers if h.get_name() == HANDLER_NAME]
    assert len(ours) == 1
    log = logging.getLogger("kvindex.test")
    for _ in range(3):
        log.warning("store down: %s", "refused", extra={"replica": "r1"})
    lines = capsys.readouterr().err.splitlines()
    bodies = [json.loads(line) for line in lines]
    assert [b["message"] for b in bodies] == ["store down: refused"]
    assert (bodies[0]["level"], bodies[0]["logger"], bodies[0]["replica"]) == (
        "WARNING",
        "kvindex.test",
        "r1",
    )
