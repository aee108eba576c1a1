"""vLLM's Prometheus ``/metrics``: where it is served and the :class:`Load` it reports."""

from __future__ import annotations

import math
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

from kvindex.api.load.model import Load, LoadError

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
GPU_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # KV_USAGE before vLLM 0.10 (read when it is absent)
_TOTAL = "_total"
_WANTED = frozenset(
    name + suffix for name in (RUNNING, WAITING, KV_USAGE, GPU_USAGE_OLD) for suffix in ("", _TOTAL)
)


def parse_vllm_metrics(text: str, *, now: float, model: str | None = None) -> Load:
    """A scraped :class:`Load` (stamped ``now``) from a vLLM ``/metrics`` exposition, summed
    over data-parallel engines (KV usage: their max), of ``model`` only when given;
    :class:`LoadError` when it does not parse, lacks these metrics, or a value is invalid."""
    values, models_seen = _collect(text, model)
    if not values:
        wanted = "" if model is None else f" for model_name={model!r}"
        seen = f" (model_name labels seen: {sorted(models_seen)})" if model is not None else ""
        raise LoadError(f"no vLLM load metrics{wanted} in the exposition{seen}")
    usage = _named(values, KV_USAGE) or _named(values, GPU_USAGE_OLD) or [0.0]
    return Load(
        running=math.fsum(_named(values, RUNNING)),
        waiting=math.fsum(_named(values, WAITING)),
        kv_usage=max(usage),
        ts=now,
        source="scrape",
    )


def _collect(text: str, model: str | None) -> tuple[dict[str, list[float]], set[str]]:
    name_to_values: dict[str, list[float]] = defaultdict(list)
    models_seen: set[str] = set()
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name not in _WANTED:
                    continue
                label = sample.labels.get("model_name")
                if label is not None:
                    models_seen.add(label)
                if model is None or label == model:
                    name_to_values[sample.name].append(float(sample.value))
    except ValueError as exc:
        raise LoadError(f"unparseable metrics exposition: {exc}") from exc
    return name_to_values, models_seen


def _named(values: dict[str, list[float]], name: str) -> list[float]:
    return values.get(name) or values.get(name + _TOTAL) or []


def metrics_url(base_url: str) -> str:
    return base_url.rstrip("/") + "/metrics"
