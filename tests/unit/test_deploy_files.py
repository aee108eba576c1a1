"""compose.yaml, the Dockerfile and the Prometheus and Grafana files under deploy/ agree with
each other, read as files: every service is probed and starts after healthy dependencies,
images are pinned, the image runs unprivileged with the compose probe as its HEALTHCHECK,
and Prometheus scrapes the ports the kvindex commands listen on; every series the dashboard
and the alerts read is one the code declares, and every proxy series is on the dashboard.
``docker compose config`` checks the file too where the compose CLI is installed; the probes
run against live processes in tests/integration/test_compose.py (the series' labels against
live pages in tests/integration/test_monitoring.py)."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from kvindex.api.config.settings import ApiSettings
from kvindex.api.health.block_sizes import BlockSizeCheck
from kvindex.api.health.ejection import EjectionMetrics
from kvindex.api.http.metrics import ApiMetrics
from kvindex.api.tokenize.protocol import Tallied
from kvindex.api.tokenize.renderers import Renderers
from kvindex.clients.proxy.metrics import ProxyMetrics
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.domain.health import StreamReport
from kvindex.indexer.fleet.registry import Registry
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.memory import MemoryIndex
from kvindex.indexer.metrics import IndexerProcessCollector, IngestCollector
from tests.integration.test_monitoring import alert_expressions, dashboard_expressions, selectors
from tests.support.paths import ROOT

COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
PROBE_ANCHOR = "x-kvindex-healthcheck"
_PINNED = re.compile(r"^[\w./-]+:(?!latest$)v?\d+(\.\d+)+$")


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return loaded


def services() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose()["services"]
    return found


def mounts(service: str) -> dict[PurePosixPath, Path]:
    """Container path → host path of a service's read-only bind mounts."""
    found: dict[PurePosixPath, Path] = {}
    for volume in services()[service].get("volumes", []):
        host, container, mode = volume.split(":")
        assert mode == "ro", volume
        found[PurePosixPath(container)] = ROOT / host
    return found


def listening_ports(command: list[Any]) -> set[int]:
    """The ports a kvindex command serves HTTP on (``--port``, ``--status-port``)."""
    args = [str(a) for a in command]
    return {int(v) for o, v in itertools.pairwise(args) if o in ("--port", "--status-port")}


def test_every_service_has_a_healthcheck() -> None:
    for name, service in services().items():
        check = service.get("healthcheck")
        assert check and check["test"][0] in ("CMD", "CMD-SHELL"), name
        assert {"interval", "timeout", "retries"} <= set(check), name


def test_dependencies_start_healthy() -> None:
    names = set(services())
    for name, service in services().items():
        depends_on = service.get("depends_on", {})
        assert isinstance(depends_on, dict), f"{name}: depends_on without conditions"
        for dependency, condition in depends_on.items():
            assert dependency in names, (name, dependency)
            assert condition == {"condition": "service_healthy"}, (name, dependency)


def test_kvindex_services_probe_a_port_their_command_serves() -> None:
    probe = compose()[PROBE_ANCHOR]
    built = {n: s for n, s in services().items() if "build" in s}
    assert set(built) == {"indexer", "api", "proxy", "sim1", "sim2", "sim3"}
    for name, service in built.items():
        assert service["healthcheck"] == probe, name
        url = service["environment"]["HEALTHCHECK_URL"]
        found = re.fullmatch(r"http://127\.0\.0\.1:(\d+)(/\w+)", url)
        assert found is not None, (name, url)
        assert int(found[1]) in listening_ports(service["command"]), (name, url)
        assert found[2] in ("/readyz", "/health"), (name, url)


def test_images_are_pinned_the_commented_vllm_one_too() -> None:
    images = [s["image"] for s in services().values() if "image" in s]
    commented = re.findall(r"^\s*#\s*image:\s*(\S+)", COMPOSE.read_text(), re.M)
    assert commented == ["vllm/vllm-openai:v0.33.0"]  # the golden frames' release
    for image in [*images, *commented]:
        assert _PINNED.match(image), image


def test_the_image_runs_unprivileged_with_the_compose_probe() -> None:
    final = DOCKERFILE.read_text().split("\nFROM ")[-1]  # the image's own stage
    lines = final.replace("\\\n", " ").splitlines()
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    checks = [line for line in lines if line.startswith("HEALTHCHECK ")]
    assert len(checks) == 1
    command = json.loads(checks[0].split(" CMD ", 1)[1])
    assert ["CMD", *command] == compose()[PROBE_ANCHOR]["test"]
    assert "ENV HEALTHCHECK_URL=http://127.0.0.1:8000/healthz" in lines  # the API's default


def test_prometheus_scrapes_every_kvindex_server_and_loads_the_alerts() -> None:
    volumes = mounts("prometheus")
    config_path = PurePosixPath("/etc/prometheus/prometheus.yml")
    config = yaml.safe_load(volumes[config_path].read_text())
    for rule_file in config["rule_files"]:
        assert config_path.parent / rule_file in volumes, rule_file
    targets = {
        target
        for job in config["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    }
    expected = {
        f"{name}:{port}"
        for name, service in services().items()
        if name in ("api", "indexer", "proxy")
        for port in listening_ports(service["command"])
    }
    assert targets == expected


def test_grafana_is_provisioned_with_the_dashboard_on_prometheus() -> None:
    volumes = mounts("grafana")
    provisioning = volumes[PurePosixPath("/etc/grafana/provisioning")]
    (source,) = yaml.safe_load((provisioning / "datasources/prometheus.yaml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["isDefault"]
    assert source["url"] == "http://prometheus:9090"
    assert "9090:9090" in services()["prometheus"]["ports"]
    (provider,) = yaml.safe_load((provisioning / "dashboards/kvindex.yaml").read_text())[
        "providers"
    ]
    folder = PurePosixPath(provider["options"]["path"])
    dashboards = [host for container, host in volumes.items() if container.parent == folder]
    assert dashboards == [ROOT / "deploy/grafana/kvindex.json"]
    assert json.loads(dashboards[0].read_text())["uid"] == "kvindex"


def _compose_cli() -> list[str] | None:
    """``docker compose`` (the plugin) or ``docker-compose``, whichever is installed."""
    for command in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(command[0]) is None:
            continue
        version = subprocess.run([*command, "version"], capture_output=True, check=False)
        if version.returncode == 0:
            return command
    return None


def test_docker_compose_config_accepts_the_file() -> None:
    command = _compose_cli()
    if command is None:
        pytest.skip("docker compose is not installed")
    checked = subprocess.run(
        [*command, "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stderr


# --- the dashboard and alerts read series the code declares -----------------------------


def declared_series() -> set[str]:
    """Every sample name a kvindex process can export (API, indexer, proxy), as declared in
    code: collected from each process's registry, with a fleet of one replica and stream."""
    fleet, index, settings = Registry((ReplicaSpec("r1", "m"),)), MemoryIndex(), ApiSettings()
    fleet.record(StreamId("r1"), StreamReport(num_batches=1))
    block_sizes = BlockSizeCheck(settings, fleet)
    api = ApiMetrics(fleet, index, block_sizes=block_sizes)
    indexer = CollectorRegistry()
    indexer.register(IngestCollector(fleet, index))
    indexer.register(IndexerProcessCollector(lambda: True))
    proxy = ProxyMetrics()
    EjectionMetrics(proxy.registry, fleet, settings)
    proxy.watch_write_path(fleet, index)
    proxy.watch_block_sizes(block_sizes)
    proxy.watch_tokenizers(_NoTokenizers())
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    return {
        family.name + suffix
        for registry in (api.registry, indexer, proxy.registry)
        for family in registry.collect()
        for suffix in suffixes.get(family.type, ("",))
    }


def test_every_series_the_dashboard_and_alerts_read_is_declared() -> None:
    declared = declared_series()
    missing = [
        f"{where}: {selector.name}"
        for where, expr in dashboard_expressions() + alert_expressions()
        for selector in selectors(where, expr)
        if selector.name not in declared
    ]
    assert not missing, missing


def test_every_proxy_series_is_on_the_dashboard() -> None:
    """An operator sees each of the proxy's series somewhere (the alerts read a few more)."""
    read = {s.name for where, expr in dashboard_expressions() for s in selectors(where, expr)}
    proxy = {
        family.name
        for family in ProxyMetrics().registry.collect()
        if family.name.startswith("kvindex_proxy_")
    }
    unread = [name for name in sorted(proxy) if not any(r.startswith(name) for r in read)]
    assert not unread, unread


class _NoTokenizers:
    """A fleet's tokenizers with none yet (their series declared, no sample)."""

    def renderers(self) -> list[Renderers]:
        return []

    def hub_verdicts(self) -> dict[str, str]:
        return {}

    def locals(self) -> list[tuple[str, Tallied]]:
        return []
