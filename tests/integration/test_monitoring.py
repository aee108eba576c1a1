"""The shipped Grafana dashboard and Prometheus alert rules read series that exist.

Every expression is parsed as PromQL (so a typo fails here, not in Grafana), and every
``kvindex_*`` series it selects, with every label it matches on, must appear in a live
``/metrics``: the API's of a running ``kvindex serve`` (which runs the write path too) and
the status port of a running ``kvindex indexer``, both fed by a publisher, and a running
``kvindex proxy``'s in front of two replica-sims, one of them failing (errors, a retry, an
ejection).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvindex.clients.fake_vllm.publisher import EventPublisher
from kvindex.indexer.domain.events import BlockStored, Tier
from tests.support.paths import ROOT
from tests.support.processes import http_ok, kvindex_child, running
from tests.support.redis_server import free_port
from tests.support.tokenizer_kinds import write_model

DASHBOARD = ROOT / "deploy" / "grafana" / "kvindex.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
MODEL = "demo-model"
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

PROXY_SERIES = (
    'kvindex_proxy_requests_total{replica="ok",route="/v1/chat/completions",status="200"}',
    'kvindex_proxy_upstream_errors_total{kind="status_500",replica="broken"}',
    "kvindex_proxy_retries_total{",
    'kvindex_proxy_ejections_total{reason="breaker",replica="broken"}',
    "kvindex_proxy_time_to_first_byte_seconds_bucket{",
)
"""Samples the proxy shows once a request has been retried after the broken replica's 500."""
PROXY_CONFIG = "[api]\nbreaker_failures = 1\n"

pytestmark = pytest.mark.timeout(90)


@dataclass(frozen=True)
class Selector:
    """A series an expression reads, and the labels it matches on or groups by."""

    name: str
    labels: frozenset[str]
    where: str


def dashboard_expressions() -> list[tuple[str, str]]:
    """(where, expr) of every dashboard panel target."""
    panels: list[dict[str, Any]] = json.loads(DASHBOARD.read_text())["panels"]
    return [
        (f"panel {panel['title']!r}", target["expr"])
        for panel in panels
        for target in panel.get("targets", [])
    ]


def alert_expressions() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [
        (f"alert {rule['alert']}", rule["expr"])
        for group in rules["groups"]
        for rule in group["rules"]
    ]


def selectors(where: str, expr: str) -> list[Selector]:
    """The ``kvindex_*`` selectors of one expression (Grafana's variables substituted)."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    found = _selectors(where, promql_parser.parse(expr))
    return [s for s in found if s.name.startswith("kvindex_")]


def _selectors(where: str, expr: promql_parser.Expr) -> list[Selector]:
    """Selectors below ``expr``; a ``by (...)`` adds its labels to every selector below it."""
    found: list[Selector] = []

    def visit(node: promql_parser.Expr) -> bool | None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            labels = frozenset(m.name for m in node.matchers.matchers)
            found.append(Selector(node.name, labels, where))
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            grouped = set(node.modifier.labels) - {"le"}
            if node.modifier.type == promql_parser.AggModifierType.By and grouped:
                for inner in _selectors(where, node.expr):
                    found.append(Selector(inner.name, inner.labels | grouped, where))
                return False  # its subtree is done
        return None

    promql_parser.walk(expr, pre_visit=visit)
    return found


def exported(text: str) -> dict[str, set[str]]:
    """Sample name → label names seen, of one /metrics page (histogram parts included)."""
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        names.setdefault(family.name, set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


@pytest.fixture(scope="module")
def live_metrics(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """Series of a running ``kvindex serve``, ``kvindex indexer`` and ``kvindex proxy``."""
    logs = tmp_path_factory.mktemp("monitoring")
    merged: dict[str, set[str]] = {}
    for page in (*_routing_and_ingest_pages(logs), _proxy_page(logs)):
        for name, labels in exported(page).items():
            merged.setdefault(name, set()).update(labels)
    return merged


def _routing_and_ingest_pages(logs: Path) -> tuple[str, str]:
    """/metrics of a ``kvindex serve`` (the model's tokenizer in its hub cache) and a
    ``kvindex indexer``, each fed one stream."""
    serve_events, indexer_events = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    api_port, status_port = free_port(), free_port()
    serve_args = ["serve", "--bind", serve_events, "--port", str(api_port)]
    indexer_args = ["indexer", "--bind", indexer_events, "--status-port", str(status_port)]
    write_model(logs / "hub" / f"models--{MODEL}" / "snapshots" / "abc")
    hub = {**os.environ, "HF_HUB_CACHE": str(logs / "hub")}
    with (
        running(logs / "serve.log", *serve_args, env=hub),
        running(logs / "indexer.log", *indexer_args),
        httpx.Client(trust_env=False, timeout=5) as http,
    ):
        api = f"http://127.0.0.1:{api_port}"
        status = f"http://127.0.0.1:{status_port}"
        _until(lambda: http.get(f"{api}/healthz").status_code == 200)
        _until(lambda: http.get(f"{status}/healthz").status_code == 200)
        for endpoint in (serve_events, indexer_events):
            _publish_until_indexed(endpoint, http, f"{api}/replicas", f"{status}/metrics")
        http.post(f"{api}/score", json={"model": MODEL, "token_ids": list(range(64))})
        http.get(f"{api}/no-such-route")
        dead = {"id": "dead", "model": MODEL, "url": f"http://127.0.0.1:{free_port()}"}
        assert http.post(f"{api}/replicas", json=dead).status_code == 201
        _until(
            lambda: (
                'kvindex_load_scrape_failures_total{replica="dead"}'
                in http.get(f"{api}/metrics").text
            )
        )  # a replica whose vLLM /metrics cannot be scraped
        # the hub's tokenizer, checked against a replica (the dead one: unchecked)
        http.post(f"{api}/score", json={"model": MODEL, "prompt": "a hub-tokenized prompt"})
        _until(lambda: "kvindex_tokenizer_hub{" in http.get(f"{api}/metrics").text)
        return http.get(f"{api}/metrics").text, http.get(f"{status}/metrics").text


def _proxy_page(logs: Path) -> str:
    """/metrics of a ``kvindex proxy`` before replica-sims ``ok`` and ``broken`` (every
    answer a 500; one failure ejects it), once it shows every sample of PROXY_SERIES."""
    config = logs / "proxy.toml"
    config.write_text(PROXY_CONFIG)
    port = free_port()
    args = ["proxy", "--port", str(port), "--config", str(config)]
    with ExitStack() as stack, httpx.Client(trust_env=False, timeout=10) as http:
        for rid, extra in (("ok", []), ("broken", ["--fail-status", "500"])):
            args += ["--replica", _start_sim(stack, logs, rid, extra)]
        proxy = kvindex_child("proxy", args, logs / "proxy.log", http_ok(port, "/readyz"))
        stack.callback(proxy.stop)
        proxy.start(40)
        base = f"http://127.0.0.1:{port}"
        for n in range(40):
            content = f"question {n} " + "word " * 40
            body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
            answer = http.post(f"{base}/v1/chat/completions", json={**body, "max_tokens": 1})
            assert answer.status_code == 200, answer.text
            page = http.get(f"{base}/metrics").text
            if all(series in page for series in PROXY_SERIES):
                return page
        missing = [series for series in PROXY_SERIES if series not in page]
        raise AssertionError(f"the proxy never showed {missing}: {proxy.tail()}")


def _start_sim(stack: ExitStack, logs: Path, rid: str, extra: list[str]) -> str:
    """A running ``kvindex replica-sim``; its ``--replica`` spec."""
    http_port, events = free_port(), f"tcp://127.0.0.1:{free_port()}"
    args = [
        "replica-sim", "--id", rid, "--model", MODEL, "--port", str(http_port),
        "--events", events, "--bind-events", "--replay", "", "--speed", "1000", *extra,
    ]  # fmt: skip
    sim = kvindex_child(f"sim {rid}", args, logs / f"{rid}.log", http_ok(http_port, "/health"))
    stack.callback(sim.stop)
    sim.start(40)
    return f"id={rid},model={MODEL},url=http://127.0.0.1:{http_port},events={events}"


def _publish_until_indexed(endpoint: str, http: httpx.Client, replicas: str, status: str) -> None:
    publisher = EventPublisher(endpoint, topic=f"kv@r1@{MODEL}")
    try:
        stored = BlockStored((1, 2, 3, 4), None, list(range(64)), 16, Tier.GPU)

        def indexed() -> bool:
            publisher.publish([stored])
            seen = http.get(replicas).text + http.get(status).text
            return '"r1"' in seen or 'replica="r1"' in seen

        _until(indexed)
    finally:
        publisher.close()


def _until(check: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("timed out")


def test_every_expression_parses_and_reads_kvindex_series() -> None:
    expressions = dashboard_expressions() + alert_expressions()
    assert len(expressions) >= 20
    for where, expr in expressions:
        assert selectors(where, expr), f"{where}: reads no kvindex series: {expr}"


def test_alert_rules_are_complete() -> None:
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_every_series_read_exists_in_a_live_metrics_page(
    live_metrics: dict[str, set[str]],
) -> None:
    missing: list[str] = []
    for where, expr in dashboard_expressions() + alert_expressions():
        for selector in selectors(where, expr):
            labels = live_metrics.get(selector.name)
            if labels is None:
                missing.append(f"{where}: {selector.name}")
            elif not selector.labels <= labels:
                missing.append(f"{where}: {selector.name} has no {selector.labels - labels}")
    assert not missing, missing
