"""The ``[discovery]`` table read: file < ``KVINDEX_DISCOVERY_*`` < the ``--k8s-*`` options."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from kvindex.indexer.config.loading import from_env_text, layered
from kvindex.indexer.domain.errors import SettingsError
from kvindex.indexer.fleet.settings import DiscoverySettings

ENV_PREFIX = "KVINDEX_DISCOVERY_"

_FIELD_TYPES = {f.name: str(f.type) for f in fields(DiscoverySettings)}


def load_discovery_settings(
    values: Any = None,
    *,
    env: Mapping[str, str],
    overrides: Mapping[str, Any] | None = None,
) -> DiscoverySettings:
    """Defaults < TOML ``[discovery]`` < ``KVINDEX_DISCOVERY_*`` < ``overrides`` (None ignored)."""
    if values is not None and not isinstance(values, Mapping):
        raise SettingsError(f"[discovery] must be a table, got {values!r}")
    raw = dict(values or {})
    unknown = sorted(set(raw) - set(_FIELD_TYPES))
    if unknown:
        raise SettingsError(
            f"[discovery]: unknown settings {unknown} (known: {sorted(_FIELD_TYPES)})"
        )
    merged = layered(raw, _from_env(env), overrides)
    if isinstance(merged.get("ports"), list | tuple):
        merged["ports"] = tuple(_port(p) for p in merged["ports"])
    return DiscoverySettings(**merged)


def _port(value: Any) -> Any:
    """A port given as text (the environment's list) as an integer; anything else as is."""
    return int(value) if isinstance(value, str) and value.isdigit() else value


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for variable in sorted(n for n in environ if n.startswith(ENV_PREFIX) and environ[n]):
        key = variable.removeprefix(ENV_PREFIX).lower()
        if key not in _FIELD_TYPES:
            known = [ENV_PREFIX + n.upper() for n in sorted(_FIELD_TYPES)]
            raise SettingsError(f"{variable}: no such discovery setting (known: {known})")
        kind = "tuple[str, ...]" if key == "ports" else _FIELD_TYPES[key]  # numbers, checked after
        found[key] = from_env_text(variable, environ[variable], kind)
    return found
