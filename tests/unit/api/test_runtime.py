"""kvindex.api.runtime: the API app and the proxy app are both built by the one assembly,
and ``kvindex api`` is built from the store's settings alone."""

from __future__ import annotations

import asyncio
from pathlib import Path
from unittest.mock import patch

import pytest
from click.testing import CliRunner

from kvindex.api.config.settings import ApiSettings, ReadPathSettings
from kvindex.api.health.checker import HealthChecker
from kvindex.api.http import app as app_module
from kvindex.api.http import core as core_module
from kvindex.api.http import server as server_module
from kvindex.api.load.store import MemoryLoadStore
from kvindex.api.runtime import ApiDeps, Hooks, ReadPath, build_read_path, open_stores
from kvindex.api.tokenize.failover import FleetTokenizers
from kvindex.clients.cli import main as cli_module
from kvindex.clients.proxy import service as proxy_module
from kvindex.clients.proxy.settings import ProxySettings
from kvindex.indexer.config.store import StoreSettings
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex

SETTINGS = ApiSettings(scrape_interval_s=0.0, health_check_interval_s=0.0)


def _deps() -> ApiDeps:
    registry = Registry((ReplicaSpec("r1", "m"),))
    return ApiDeps(SETTINGS, MemoryIndex(), registry, MemoryLoadStore(), blocking_store=False)


class _Spy:
    """``build_read_path``, remembering each runtime it built."""

    def __init__(self) -> None:
        self.built: list[ReadPath] = []

    def __call__(self, deps: ApiDeps, hooks: Hooks | None = None) -> ReadPath:
        runtime = build_read_path(deps, hooks)
        self.built.append(runtime)
        return runtime


def test_the_api_app_and_the_proxy_app_are_built_by_the_one_assembly() -> None:
    spy = _Spy()
    with (
        patch.object(core_module, "build_read_path", spy),
        patch.object(proxy_module, "build_read_path", spy),
    ):
        api = app_module.create_app(_deps())
        served, _ = server_module.served_app(_deps())
        proxy = proxy_module.build_proxy_app(_deps(), ProxySettings())
    assert spy.built == [api.state.read_path, served.core.read_path, proxy.state.read_path]
    assert isinstance(api.state.read_path.tokenizers, FleetTokenizers)  # the same kind
    assert isinstance(proxy.state.read_path.tokenizers, FleetTokenizers)


def test_the_runtime_starts_and_stops_its_parts() -> None:
    runtime = build_read_path(_deps())
    assert isinstance(runtime.health_checker, HealthChecker)
    assert runtime.scraper is None  # scrape_interval_s = 0

    async def run() -> bool:
        await runtime.start()
        await runtime.stop()
        return runtime.http.is_closed

    assert asyncio.run(run())


def test_the_memory_store_is_read_where_it_is_written() -> None:
    with pytest.raises(ValueError, match="memory store"):
        open_stores(ReadPathSettings(StoreSettings(), SETTINGS))


def test_kvindex_api_is_built_from_the_store_settings_alone(tmp_path: Path) -> None:
    """An indexer key the API never reads does not stop it, even with a value the indexer
    would refuse on Redis; an unknown key still does."""
    config = tmp_path / "kvindex.toml"
    config.write_text('redis_prefix = "p"\ningest_workers = 2\n\n[api]\nport = 9001\n')
    seen: list[ReadPathSettings] = []
    with (
        patch.object(server_module, "serve_api", seen.append),  # the command imports it when run
        patch.object(cli_module, "check_port", lambda host, port: None),
    ):
        result = CliRunner().invoke(
            cli_module.main, ["api", "--config", str(config), "--redis-url", "redis://h:1/0"]
        )
    assert result.exit_code == 0, result.output
    (settings,) = seen
    assert type(settings.store) is StoreSettings
    assert (settings.store.store, settings.store.redis_url) == ("redis", "redis://h:1/0")
    assert (settings.store.redis_prefix, settings.api.port) == ("p", 9001)
    config.write_text("no_such_key = 1\n")
    result = CliRunner().invoke(cli_module.main, ["api", "--config", str(config)])
    assert result.exit_code == 1
    assert "unknown settings ['no_such_key']" in result.output
