"""The ``kvindex`` group (clients/cli/main.py): what it loads, its help, its log options."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from kvindex.clients.cli.log_format import HANDLER_NAME, JsonFormatter
from kvindex.clients.cli.main import main
from kvindex.clients.proxy import service

HEAVY = ("fastapi", "uvicorn", "redis", "matplotlib")

_VERSION = """
import json, sys
from kvindex.clients.cli.main import main  # the console script's import
main(["--version"], standalone_mode=False)
print(json.dumps(sorted({name.partition(".")[0] for name in sys.modules})))
"""

MARKUP = re.compile(r"`|:(?:func|class|mod|data|meth|attr|ref):")
"""reStructuredText in prose written for the API docs: not for a terminal."""


def test_the_version_loads_no_web_stack_nor_redis_nor_plotting() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _VERSION], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout.splitlines()[-1]))
    assert "click" in loaded
    assert loaded.isdisjoint(HEAVY), sorted(loaded & set(HEAVY))


def test_the_help_lists_every_summary_whole() -> None:
    shown = CliRunner().invoke(main, ["--help"])
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.output.partition("Commands:")[2].split())
    assert "..." not in text and "…" not in text
    for name, command in main.commands.items():
        summary = " ".join(command.get_short_help_str(limit=1_000).split())
        assert f"{name} {summary}" in text


def test_no_help_shows_markup() -> None:
    with click.Context(main, info_name="kvindex") as group:
        assert not MARKUP.search(main.get_help(group))
        for name, command in main.commands.items():
            with click.Context(command, info_name=name, parent=group) as ctx:
                assert not MARKUP.search(command.get_help(ctx)), name


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """The root logger, its handlers and level put back after the test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def installed(root: logging.Logger) -> logging.Handler:
    return next(h for h in root.handlers if h.get_name() == HANDLER_NAME)


@pytest.mark.parametrize(
    ("before", "after", "json_lines", "level"),
    [
        ([], ["--log-format", "json", "--log-level", "warning"], True, logging.WARNING),
        (["--log-format", "json", "--log-level", "error"], [], True, logging.ERROR),
        (["--log-format", "json", "-v"], ["--log-format", "text"], False, logging.DEBUG),
        ([], [], False, logging.INFO),
    ],
)
def test_log_options_are_taken_before_and_after_the_command(
    root_logger: logging.Logger,
    before: list[str],
    after: list[str],
    json_lines: bool,
    level: int,
) -> None:
    args = [*before, "stats", "--url", "http://127.0.0.1:1", *after]  # nothing listens: exit 1
    result = CliRunner().invoke(main, args, env={"KVINDEX_LOG_FORMAT": None})
    assert result.exit_code == 1, result.output
    assert isinstance(installed(root_logger).formatter, JsonFormatter) == json_lines
    assert root_logger.level == level


def test_every_command_takes_the_log_options() -> None:
    for name, command in main.commands.items():
        options = {opt for param in command.params for opt in param.opts}
        assert {"--log-format", "--log-level"} <= options, name


def test_the_proxy_listens_on_its_own_port_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """8080 (compose's), not the API's 8000."""
    ports: list[int] = []

    def serve_proxy(_settings: Any, api: Any, _proxy: Any) -> None:
        ports.append(api.port)

    monkeypatch.setattr(service, "serve_proxy", serve_proxy)
    # and where an import at the top of main.py would have bound it (the proxy never runs)
    monkeypatch.setattr("kvindex.clients.cli.main.serve_proxy", serve_proxy, raising=False)
    monkeypatch.setattr("kvindex.clients.cli.main.check_port", lambda *_: None, raising=False)
    env = {"KVINDEX_API_PORT": None, "KVINDEX_API_HOST": None}
    result = CliRunner().invoke(main, ["proxy", "--store", "memory"], env=env)
    assert result.exit_code == 0, result.output
    assert ports == [8080]


def test_the_proxy_port_is_a_proxy_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``[proxy] port`` in the file, then ``KVINDEX_PROXY_PORT``, then ``--port``."""
    ports: list[int] = []
    monkeypatch.setattr(service, "serve_proxy", lambda _s, api, _p: ports.append(api.port))
    monkeypatch.setattr("kvindex.clients.cli.main.check_port", lambda *_: None, raising=False)
    config = tmp_path / "kvindex.toml"
    config.write_text("[proxy]\nport = 9101\n")
    args = ["proxy", "--store", "memory", "--config", str(config)]
    for env, extra in (({}, []), ({"KVINDEX_PROXY_PORT": "9102"}, []), ({}, ["--port", "9103"])):
        result = CliRunner().invoke(main, args + extra, env={"KVINDEX_PROXY_PORT": None, **env})
        assert result.exit_code == 0, result.output
    assert ports == [9101, 9102, 9103]


def test_the_proxy_options_reach_its_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every forwarding option to its ``proxy.*`` key; ``--extra-route`` only when given
    (else the file's); ``--access-log`` to ``api.access_log``, as for ``kvindex api``."""
    seen: list[tuple[Any, Any]] = []
    monkeypatch.setattr(service, "serve_proxy", lambda _s, api, proxy: seen.append((api, proxy)))
    monkeypatch.setattr("kvindex.clients.cli.main.check_port", lambda *_: None, raising=False)
    config = tmp_path / "kvindex.toml"
    config.write_text('[proxy]\nextra_routes = ["/v1/load_lora_adapter"]\n')
    base = ["proxy", "--store", "memory", "--config", str(config)]
    given = [
        "--retry-backoff-s", "0.1", "--retry-backoff-max-s", "2", "--max-connections", "7",
        "--forward-client-authorization", "--extra-route", "/v1/a", "--extra-route", "/v1/b",
        "--access-log",
    ]  # fmt: skip
    env = {"KVINDEX_API_ACCESS_LOG": None}
    for args in (base, base + given):
        result = CliRunner().invoke(main, args, env=env)
        assert result.exit_code == 0, result.output
    (api, proxy), (api_given, proxy_given) = seen
    assert proxy.extra_routes == ("/v1/load_lora_adapter",) and not api.access_log
    assert proxy_given.extra_routes == ("/v1/a", "/v1/b") and api_given.access_log
    assert (proxy_given.retry_backoff_s, proxy_given.retry_backoff_max_s) == (0.1, 2.0)
    assert proxy_given.max_connections == 7 and proxy_given.forward_client_authorization


@pytest.mark.parametrize("command", ["indexer", "serve", "proxy", "picker"])
def test_a_bad_discovery_option_stops_the_command_with_the_key_named(command: str) -> None:
    result = CliRunner().invoke(main, [command, "--k8s-selector", "app=vllm"])
    assert result.exit_code == 1
    assert "discovery.selector needs 1 to 8 discovery.ports" in result.output
    result = CliRunner().invoke(main, [command, "--k8s-pool", "p", "--k8s-selector", "a=b"])
    assert "exclude each other" in result.output
