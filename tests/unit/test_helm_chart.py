"""deploy/helm/kvindex renders with Helm's own engine (the Helm Go SDK that helm-python-sdk
bundles) and every manifest validates: the built-in kinds against the Kubernetes schemas that
kubernetes-validate bundles (strict: no unknown field), at the oldest Kubernetes the chart
supports and the newest; HTTPRoute, ServiceMonitor and PrometheusRule against their CRDs'
published schemas too (the npm kubernetes-models packages, tests/support/crds, run by node);
every custom resource, InferencePool included (no package ships its CRD), against the
structural schemas of tests/support/crd_schemas.py. The containers' options and variables are
ones the kvindex commands and settings take; the dashboard and the rules in the chart are
copies of deploy/'s; every value is documented in values.yaml and in docs/kubernetes.md."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import fields
from importlib.metadata import version
from typing import Any

import click
import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvindex.api.config.settings import ApiSettings
from kvindex.clients.cli.main import main as cli
from kvindex.clients.picker.service import HEALTH_SERVICES
from kvindex.clients.proxy.settings import ProxySettings
from kvindex.indexer.config.settings import IndexerSettings
from tests.support.crd_schemas import CRD_SCHEMAS
from tests.support.paths import ROOT

CHART = ROOT / "deploy" / "helm" / "kvindex"
EXAMPLES = CHART / "examples"
DOCS = ROOT / "docs" / "kubernetes.md"
RELEASE, NAMESPACE = "kvindex", "serving"
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
"""The chart's kubeVersion floor (gRPC probes) and the newest schemas bundled."""

POOL = {"discovery": {"pool": "llama"}}
STATIC = {"replicas": ["id=r1,model=m,url=http://10.0.0.7:8000,events=tcp://10.0.0.7:5557"]}
EVERYTHING: dict[str, Any] = {
    "discovery": {
        "selector": "app=vllm",
        "ports": [8000, 8001],
        "namespace": "models",
        "model": "meta-llama/Llama-3.1-8B-Instruct",
    },
    "config": '[picker]\nnum_endpoints = 2\n\n[[models]]\nname = "m"\ntokenizer = "replica"\n',
    "proxy": {"enabled": True, "authSecret": "proxy-token", "upstreamApiKeySecret": "vllm-key"},
    "api": {"authSecret": "api-token"},
    "redis": {"auth": {"enabled": True, "existingSecret": "redis-pass"}},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "prometheusRule": {"enabled": True},
    "imagePullSecrets": [{"name": "regcred"}],
    "hubCache": {"existingClaim": "vllm-models", "subPath": "hub"},
}
EXTERNAL = {
    **POOL,
    "redis": {"enabled": False, "externalUrl": "redis://:s3cret@redis.example:6379/2"},
}
SCENARIOS: dict[str, dict[str, Any]] = {
    "pool": POOL,
    "static": STATIC,
    "everything": EVERYTHING,
    "external": EXTERNAL,
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """The release's manifests, as Helm renders them for an install."""
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [found] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def containers(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for doc in docs:
        if doc["kind"] == "Deployment":
            for container in doc["spec"]["template"]["spec"]["containers"]:
                yield doc["metadata"]["name"], container


def validate(doc: dict[str, Any], version: str) -> None:
    schema = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if schema is None:
        kubernetes_validate.validate(doc, version, strict=True)
    else:
        jsonschema.validate(doc, schema)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(values) for name, values in SCENARIOS.items()}


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_manifest_validates(rendered: dict[str, list[dict[str, Any]]], version: str) -> None:
    for docs in rendered.values():
        for doc in docs:
            validate(doc, version)
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            validate(doc, version)


CRDS = ROOT / "tests" / "support" / "crds"


def published_schema_errors(objects: list[dict[str, Any]]) -> dict[tuple[str, str], str | None]:
    """(kind, name) → the error of the CRD's published schema (None: valid), run by node."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: custom resources get the structural check only")
    assert (CRDS / "node_modules").is_dir(), "the CRD schemas are not installed: make install"
    done = subprocess.run(
        [node, str(CRDS / "validate.mjs")],
        input=json.dumps(objects), capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    results = [json.loads(line) for line in done.stdout.splitlines()]
    return {(r["kind"], r["name"]): r["error"] for r in results}


def test_custom_resources_validate_against_published_schemas(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = [d for d in rendered["everything"] if "monitoring.coreos.com" in d["apiVersion"]]
    for path in sorted(EXAMPLES.glob("*.yaml")):
        objects += [d for d in yaml.safe_load_all(path.read_text()) if d["kind"] == "HTTPRoute"]
    wrong = copy.deepcopy(next(d for d in objects if d["kind"] == "HTTPRoute"))
    wrong["metadata"]["name"] = "wrong"
    wrong["spec"]["rules"][0]["timeouts"]["request"] = "5 minutes"
    errors = published_schema_errors([*objects, wrong])
    assert {kind for kind, _ in errors} == {"HTTPRoute", "ServiceMonitor", "PrometheusRule"}
    assert errors.pop(("HTTPRoute", "wrong")) is not None
    assert {key: error for key, error in errors.items() if error} == {}


def test_validation_can_fail() -> None:
    """The validators refuse a misspelt field and a bad enum (so the test above can fail)."""
    deployment = one(render(POOL), "Deployment", "kvindex-picker")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment, KUBE_VERSIONS[0])
    [pool] = [
        d
        for d in yaml.safe_load_all((EXAMPLES / "gateway.yaml").read_text())
        if d["kind"] == "InferencePool"
    ]
    pool["spec"]["endpointPickerRef"]["failureMode"] = "Sometimes"
    with pytest.raises(jsonschema.ValidationError):
        validate(pool, KUBE_VERSIONS[0])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_lint_is_clean(scenario: str) -> None:
    """``helm lint --strict``: no error, no warning (an info, such as "icon is recommended",
    is allowed)."""
    report = helm.lint(CHART, SCENARIOS[scenario], strict=True, namespace=NAMESPACE)
    assert not report["errors"], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_replicas_must_come_from_somewhere() -> None:
    with pytest.raises(
        helm.HelmError, match=re.escape("discovery.pool, discovery.selector or replicas")
    ):
        render({})
    with pytest.raises(
        helm.HelmError, match=re.escape("redis.externalUrl or redis.existingUrlSecret")
    ):
        render({**POOL, "redis": {"enabled": False}})


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_arguments_are_the_commands_options(
    rendered: dict[str, list[dict[str, Any]]], scenario: str
) -> None:
    """Each container runs a kvindex command with options it takes (click parses them, the
    replicas included), serving on its container ports."""
    for deployment, container in containers(rendered[scenario]):
        if container["name"] == "redis":
            continue
        command, *args = container["args"]
        sub = cli.commands[command]
        if any(a.startswith("--k8s-") for a in args) and not _has_option(sub, "--k8s-pool"):
            pytest.skip(f"kvindex {command} has no discovery options (--k8s-*) in this build")
        params = sub.make_context(command, list(args)).params
        ports = {p["containerPort"] for p in container["ports"]}
        for key in ("port", "status_port", "metrics_port"):
            if params.get(key) is not None:
                assert params[key] in ports, (deployment, key)


def _has_option(command: click.Command, option: str) -> bool:
    return any(option in p.opts for p in command.params)


def test_static_replicas_reach_the_indexer() -> None:
    """The picker and the proxy read the fleet the indexers keep in Redis."""
    docs = render({**STATIC, "proxy": {"enabled": True}})
    for name in ("kvindex-indexer", "kvindex-picker", "kvindex-proxy"):
        [container] = one(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"]
        replicas = ["--replica", STATIC["replicas"][0]]
        assert (container["args"][-2:] == replicas) == (name == "kvindex-indexer"), name
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]


def test_discovery_options(rendered: dict[str, list[dict[str, Any]]]) -> None:
    [indexer] = one(rendered["everything"], "Deployment", "kvindex-indexer")["spec"]["template"][
        "spec"
    ]["containers"]
    args = indexer["args"]
    assert args[args.index("--k8s-selector") + 1] == "app=vllm"
    assert [args[i + 1] for i, a in enumerate(args) if a == "--k8s-port"] == ["8000", "8001"]
    assert args[args.index("--k8s-namespace") + 1] == "models"
    assert args[args.index("--k8s-model") + 1] == "meta-llama/Llama-3.1-8B-Instruct"
    [picker] = one(rendered["pool"], "Deployment", "kvindex-picker")["spec"]["template"]["spec"][
        "containers"
    ]
    assert not [a for a in picker["args"] if a.startswith("--k8s-")]  # it reads Redis's fleet
    [indexer] = one(rendered["pool"], "Deployment", "kvindex-indexer")["spec"]["template"]["spec"][
        "containers"
    ]
    assert indexer["args"][-4:] == ["--k8s-pool", "llama", "--k8s-namespace", NAMESPACE]


def test_variables_are_settings(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Every KVINDEX_* variable a container gets names a setting of its process."""
    known = {"KVINDEX_" + f.name.upper() for f in fields(IndexerSettings)}
    known |= {"KVINDEX_API_" + f.name.upper() for f in fields(ApiSettings)}
    known |= {"KVINDEX_PROXY_" + f.name.upper() for f in fields(ProxySettings)}
    for docs in rendered.values():
        for deployment, container in containers(docs):
            for var in container.get("env", []):
                if var["name"].startswith("KVINDEX_"):
                    assert var["name"] in known, (deployment, var["name"])


def test_the_read_path_reads_tokenizers_from_the_hub_cache_it_mounts_read_only(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """api, picker and proxy mount the claim read only and are told where; the indexer, and
    a release without ``hubCache``, mount nothing; a hostPath validates; both at once fail."""
    for deployment, container in containers(rendered["everything"]):
        env = {v["name"]: v.get("value") for v in container.get("env", [])}
        mounts = {m["name"]: m for m in container.get("volumeMounts", [])}
        if deployment.endswith(("-api", "-picker", "-proxy")):
            assert env["KVINDEX_API_HF_HUB_CACHE"] == "/hf-hub", deployment
            assert mounts["hf-hub"] == {
                "name": "hf-hub", "mountPath": "/hf-hub", "readOnly": True, "subPath": "hub"
            }  # fmt: skip
        else:
            assert "hf-hub" not in mounts and "KVINDEX_API_HF_HUB_CACHE" not in env, deployment
    pod = one(rendered["everything"], "Deployment", "kvindex-api")["spec"]["template"]["spec"]
    claim = {"claimName": "vllm-models", "readOnly": True}
    assert {"name": "hf-hub", "persistentVolumeClaim": claim} in pod["volumes"]
    for _, container in containers(rendered["pool"]):
        assert "hf-hub" not in json.dumps(container)
    on_nodes = render({**POOL, "hubCache": {"hostPath": "/var/lib/hf/hub"}})
    for doc in on_nodes:
        validate(doc, KUBE_VERSIONS[-1])
    with pytest.raises(Exception, match=r"one of hubCache\.existingClaim and hubCache\.hostPath"):
        render({**POOL, "hubCache": {"existingClaim": "c", "hostPath": "/h"}})


def test_indexers_are_sharded_on_redis(rendered: dict[str, list[dict[str, Any]]]) -> None:
    deployment = one(rendered["pool"], "Deployment", "kvindex-indexer")
    assert deployment["spec"]["replicas"] == 2
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["args"][:3] == ["indexer", "--store", "redis"]
    env = {v["name"]: v for v in container["env"]}
    assert env["KVINDEX_INDEXER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["KVINDEX_REDIS_URL"]["value"] == "redis://kvindex-redis:6379/0"
    assert env["KVINDEX_STATUS_HOST"]["value"] == "0.0.0.0"


def test_probes_are_the_health_routes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for deployment, container in containers(rendered["everything"]):
        names = {p["name"] for p in container["ports"]}
        for kind in ("livenessProbe", "readinessProbe"):
            probe = container[kind]
            if "httpGet" in probe:
                assert probe["httpGet"]["path"] == {"livenessProbe": "/healthz"}.get(
                    kind, "/readyz"
                ), (deployment, kind)
                assert probe["httpGet"]["port"] in names
            elif "grpc" in probe:
                assert probe["grpc"]["service"] in HEALTH_SERVICES
                assert probe["grpc"]["port"] in {p["containerPort"] for p in container["ports"]}
            else:
                assert container["name"] == "redis", (deployment, kind)


def test_containers_run_unprivileged(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for docs in rendered.values():
        for doc in docs:
            if doc["kind"] != "Deployment":
                continue
            pod = doc["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True
            for container in pod["containers"]:
                context = container["securityContext"]
                assert context["readOnlyRootFilesystem"] is True
                assert context["allowPrivilegeEscalation"] is False
                assert context["runAsUser"] != 0
                assert container["resources"]["requests"]


def _plain_text(docs: list[dict[str, Any]]) -> str:
    """Everything but Secrets' data."""
    return json.dumps([d for d in docs if d["kind"] != "Secret"])


def test_redis_credentials_stay_in_secrets(rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert "s3cret" not in _plain_text(rendered["external"])
    [container] = one(rendered["external"], "Deployment", "kvindex-api")["spec"]["template"][
        "spec"
    ]["containers"]
    [url] = [v for v in container["env"] if v["name"] == "KVINDEX_REDIS_URL"]
    assert url["valueFrom"]["secretKeyRef"] == {"name": "kvindex-redis-url", "key": "url"}
    for _, container in containers(rendered["everything"]):
        env = {v["name"]: v for v in container.get("env", [])}
        if container["name"] == "redis":
            assert container["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
        else:
            assert env["KVINDEX_REDIS_URL"]["value"] == (
                "redis://:$(REDIS_PASSWORD)@kvindex-redis:6379/0"
            )
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "redis-pass"
    assert not [d for d in rendered["everything"] if d["kind"] == "Secret"]
    docs = render({**POOL, "redis": {"auth": {"enabled": True, "password": "pw0rd"}}})
    assert "pw0rd" not in _plain_text(docs)
    assert one(docs, "Secret", "kvindex-redis")["data"] == {"password": "cHcwcmQ="}


def test_discovery_rbac(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["everything"]
    role = one(docs, "Role", "kvindex-discovery")
    assert role["metadata"]["namespace"] == "models"
    rules = {
        (g, r): set(rule["verbs"])
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert rules == {
        ("", "pods"): {"get", "list", "watch"},
        ("inference.networking.k8s.io", "inferencepools"): {"get", "list", "watch"},
    }
    binding = one(docs, "RoleBinding", "kvindex-discovery")
    assert binding["roleRef"]["name"] == "kvindex-discovery"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kvindex", "namespace": NAMESPACE}
    ]
    for name in ("kvindex-indexer", "kvindex-picker", "kvindex-proxy"):
        pod = one(docs, "Deployment", name)["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "kvindex"
    assert (
        one(docs, "Deployment", "kvindex-api")["spec"]["template"]["spec"][
            "automountServiceAccountToken"
        ]
        is False
    )


def test_services_select_their_pods(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["everything"]
    for service in (d for d in docs if d["kind"] == "Service"):
        deployment = one(docs, "Deployment", service["metadata"]["name"])
        pod = deployment["spec"]["template"]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        names = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= names
    for monitor in (d for d in docs if d["kind"] == "ServiceMonitor"):
        service = one(docs, "Service", monitor["metadata"]["name"])
        labels = monitor["spec"]["selector"]["matchLabels"]
        assert labels.items() <= service["metadata"]["labels"].items()
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        [endpoint] = monitor["spec"]["endpoints"]
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceMonitor"}
    assert set(monitors) == {f"kvindex-{c}" for c in ("indexer", "api", "picker", "proxy")}
    auth = monitors["kvindex-api"]["spec"]["endpoints"][0]["authorization"]
    assert auth["credentials"] == {"name": "api-token", "key": "token"}


def test_examples_point_the_gateway_at_the_picker(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    examples = list(yaml.safe_load_all((EXAMPLES / "gateway.yaml").read_text()))
    [pool] = [d for d in examples if d["kind"] == "InferencePool"]
    [route] = [d for d in examples if d["kind"] == "HTTPRoute"]
    picker = one(rendered["pool"], "Service", pool["spec"]["endpointPickerRef"]["name"])
    [grpc] = [p for p in picker["spec"]["ports"] if p["name"] == "grpc"]
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] == grpc["port"]
    assert pool["metadata"]["name"] == POOL["discovery"]["pool"]
    [backend] = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool["metadata"]["name"],
    )
    [server] = [d for d in yaml.safe_load_all((EXAMPLES / "vllm-pod-annotations.yaml").read_text())]
    template = server["spec"]["template"]["metadata"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= template["labels"].items()
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= {
        p["containerPort"] for p in server["spec"]["template"]["spec"]["containers"][0]["ports"]
    }


def test_dashboard_and_rules_are_copies_of_deploy() -> None:
    """Helm reads files inside the chart only: the chart links to deploy/'s dashboard and rules
    (a copy, were the links replaced, must equal them)."""
    pairs = [
        (CHART / "dashboards" / "kvindex.json", ROOT / "deploy" / "grafana" / "kvindex.json"),
        (CHART / "rules" / "alerts.yaml", ROOT / "deploy" / "prometheus" / "alerts.yaml"),
    ]
    for in_chart, source in pairs:
        assert in_chart.read_bytes() == source.read_bytes(), f"cp {source} {in_chart}"


def test_dashboard_configmap(rendered: dict[str, list[dict[str, Any]]]) -> None:
    config_map = one(rendered["pool"], "ConfigMap", "kvindex-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    source = json.loads((ROOT / "deploy" / "grafana" / "kvindex.json").read_text())
    assert json.loads(config_map["data"]["kvindex.json"]) == source
    rule = one(rendered["everything"], "PrometheusRule", "kvindex")
    alerts = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yaml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]


_OPAQUE = {"resources", "seccompProfile", "capabilities", "labels"}
"""Values documented whole, not key by key."""
_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z]\w*):")


def documented_values() -> dict[str, bool]:
    """Each value's dotted path in values.yaml → whether a comment line stands above it."""
    found: dict[str, bool] = {}
    stack: list[tuple[int, str]] = []
    previous = ""
    for line in (CHART / "values.yaml").read_text().splitlines():
        match = _KEY.match(line)
        if match:
            indent = len(match["indent"])
            stack = [(i, k) for i, k in stack if i < indent]
            if not any(k in _OPAQUE for _, k in stack):
                found[".".join([k for _, k in stack] + [match["key"]])] = (
                    previous.lstrip().startswith("#")
                )
            stack.append((indent, match["key"]))
        previous = line
    return found


def _shown(value: Any) -> str:
    """A default as the docs' values table shows it."""
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{json.dumps(value)}`"


def test_every_value_is_documented() -> None:
    """Each value has its comment in values.yaml and its row in the docs, with its default."""
    values = documented_values()
    assert [path for path, commented in values.items() if not commented] == []
    rows = re.findall(r"^\| `([\w.]+)` \| (`.*?`) \|", DOCS.read_text(), re.MULTILINE)
    sections = {p for p in values if any(q.startswith(p + ".") for q in values)}
    assert {path for path, _ in rows} == set(values) - sections
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    for path, shown in rows:
        value = defaults
        for key in path.split("."):
            value = value[key]
        assert shown == _shown(value), path


def test_values_file_is_the_charts_defaults() -> None:
    with helm.Chart.load(CHART) as chart:
        assert chart.values == yaml.safe_load((CHART / "values.yaml").read_text())
        assert chart.name == "kvindex"
        # The default image tag is the appVersion: the package's own version.
        assert chart.metadata["appVersion"] == version("kvindex")
