"""JSON Schemas of the custom resources the Helm chart and its examples write, by (apiVersion,
kind): written from the published API references (GIE's inference.networking.k8s.io/v1, Gateway
API v1, Prometheus Operator monitoring.coreos.com/v1), for the fields kvindex uses plus their
siblings. Structural: required fields, types, enums, bounds; a field not listed is refused, so
a misspelt one fails (the CRDs' own schemas prune unknown fields instead). The published
schemas are checked too where a package ships them (tests/support/crds); InferencePool's, none."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def _object(properties: Schema, required: tuple[str, ...] = ()) -> Schema:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


def _map_of_strings() -> Schema:
    return {"type": "object", "additionalProperties": {"type": "string"}}


_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
"""Gateway API's Duration (GEP-2257)."""
_PROM_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)(y|w|d|h|m|s|ms))+)$"}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": _NAME,
        "namespace": {"type": "string"},
        "labels": _map_of_strings(),
        "annotations": _map_of_strings(),
    },
}


def _resource(api_version: str, kind: str, spec: Schema) -> Schema:
    return _object(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        ("apiVersion", "kind", "metadata", "spec"),
    )


_LABEL_VALUE = {
    "type": "string",
    "maxLength": 63,
    "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
}
INFERENCE_POOL = _resource(
    "inference.networking.k8s.io/v1",
    "InferencePool",
    _object(
        {
            "selector": _object(
                {
                    "matchLabels": {
                        "type": "object",
                        "minProperties": 1,
                        "additionalProperties": _LABEL_VALUE,
                    }
                },
                ("matchLabels",),
            ),
            "targetPorts": {
                "type": "array",
                "minItems": 1,
                "maxItems": 8,
                "uniqueItems": True,
                "items": _object({"number": _PORT}, ("number",)),
            },
            "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
            "endpointPickerRef": _object(
                {
                    "group": {"type": "string", "maxLength": 253},
                    "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                    "name": _NAME,
                    "port": _object({"number": _PORT}, ("number",)),
                    "failureMode": {"enum": ["FailOpen", "FailClose"]},
                },
                ("name",),
            ),
        },
        ("selector", "targetPorts", "endpointPickerRef"),
    ),
)

_REF = _object(
    {
        "group": {"type": "string"},
        "kind": {"type": "string"},
        "name": _NAME,
        "namespace": {"type": "string"},
        "sectionName": {"type": "string"},
        "port": _PORT,
    },
    ("name",),
)
_MATCH = _object(
    {
        "path": _object(
            {
                "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                "value": {"type": "string", "maxLength": 1024},
            }
        ),
        "headers": {"type": "array", "maxItems": 16},
        "queryParams": {"type": "array", "maxItems": 16},
        "method": {
            "enum": ["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"]
        },
    }
)
_BACKEND = _object(
    {
        "group": {"type": "string"},
        "kind": {"type": "string"},
        "name": _NAME,
        "namespace": {"type": "string"},
        "port": _PORT,
        "weight": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "filters": {"type": "array"},
    },
    ("name",),
)
HTTP_ROUTE = _resource(
    "gateway.networking.k8s.io/v1",
    "HTTPRoute",
    _object(
        {
            "parentRefs": {"type": "array", "maxItems": 32, "items": _REF},
            "hostnames": {"type": "array", "maxItems": 16, "items": {"type": "string"}},
            "rules": {
                "type": "array",
                "maxItems": 16,
                "items": _object(
                    {
                        "name": {"type": "string"},
                        "matches": {"type": "array", "maxItems": 64, "items": _MATCH},
                        "filters": {"type": "array", "maxItems": 16},
                        "backendRefs": {"type": "array", "maxItems": 16, "items": _BACKEND},
                        "timeouts": _object({"request": _DURATION, "backendRequest": _DURATION}),
                        "retry": {"type": "object"},
                        "sessionPersistence": {"type": "object"},
                    }
                ),
            },
        }
    ),
)

_SECRET_KEY = _object(
    {"name": _NAME, "key": {"type": "string"}, "optional": {"type": "boolean"}}, ("key",)
)
_ENDPOINT = _object(
    {
        "port": {"type": "string"},
        "targetPort": {"type": ["integer", "string"]},
        "path": {"type": "string"},
        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
        "interval": _PROM_DURATION,
        "scrapeTimeout": _PROM_DURATION,
        "honorLabels": {"type": "boolean"},
        "honorTimestamps": {"type": "boolean"},
        "authorization": _object({"type": {"type": "string"}, "credentials": _SECRET_KEY}),
        "bearerTokenSecret": _SECRET_KEY,
        "tlsConfig": {"type": "object"},
        "relabelings": {"type": "array"},
        "metricRelabelings": {"type": "array"},
        "params": {"type": "object"},
    }
)
_LABEL_SELECTOR = _object({"matchLabels": _map_of_strings(), "matchExpressions": {"type": "array"}})
SERVICE_MONITOR = _resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    _object(
        {
            "selector": _LABEL_SELECTOR,
            "namespaceSelector": _object(
                {
                    "any": {"type": "boolean"},
                    "matchNames": {"type": "array", "items": {"type": "string"}},
                }
            ),
            "endpoints": {"type": "array", "items": _ENDPOINT},
            "jobLabel": {"type": "string"},
            "targetLabels": {"type": "array"},
            "podTargetLabels": {"type": "array"},
            "sampleLimit": {"type": "integer", "minimum": 0},
        },
        ("selector",),
    ),
)

_RULE = {
    "type": "object",
    "required": ["expr"],
    "additionalProperties": False,
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
    "properties": {
        "alert": {"type": "string"},
        "record": {"type": "string"},
        "expr": {"type": ["string", "integer"]},
        "for": _PROM_DURATION,
        "keep_firing_for": _PROM_DURATION,
        "labels": _map_of_strings(),
        "annotations": _map_of_strings(),
    },
}
PROMETHEUS_RULE = _resource(
    "monitoring.coreos.com/v1",
    "PrometheusRule",
    _object(
        {
            "groups": {
                "type": "array",
                "items": _object(
                    {
                        "name": {"type": "string", "minLength": 1},
                        "interval": _PROM_DURATION,
                        "limit": {"type": "integer"},
                        "partial_response_strategy": {"type": "string"},
                        "labels": _map_of_strings(),
                        "rules": {"type": "array", "items": _RULE},
                    },
                    ("name",),
                ),
            },
        }
    ),
)

CRD_SCHEMAS: dict[tuple[str, str], Schema] = {
    (s["properties"]["apiVersion"]["const"], s["properties"]["kind"]["const"]): s
    for s in (INFERENCE_POOL, HTTP_ROUTE, SERVICE_MONITOR, PROMETHEUS_RULE)
}
