"""Loads shared by the load tests: a fixed measurement time and a valid load to vary."""

from __future__ import annotations

from kvindex.api.load.model import Load

NOW = 1_700_000_000.5


def a_load(**changes: object) -> Load:
    fields: dict[str, object] = {
        "running": 1.0,
        "waiting": 2.0,
        "kv_usage": 0.5,
        "ts": NOW,
        "source": "push",
    }
    fields.update(changes)
    return Load(**fields)  # type: ignore[arg-type]
