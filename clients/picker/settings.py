"""The picker's frozen settings (TOML ``[picker]``, ``KVINDEX_PICKER_*``), validated when
built: a bad value is a SettingsError naming its ``picker.*`` key (and the variable that set it)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvindex.indexer.config.loading import ConfigFile, from_env_text, layered
from kvindex.indexer.domain.errors import SettingsError


@dataclass(frozen=True, slots=True)
class PickerSettings:
    """How the endpoint picker listens, names endpoints and sheds."""

    port: int = 9002
    """gRPC port of the ext_proc and health services (GIE's own picker's default)."""
    metrics_port: int = 9090
    """Plain-HTTP port of ``/metrics``, ``/healthz``, ``/readyz`` (0: any free one; -1: none)."""
    num_endpoints: int = 3
    """Endpoints named per request: the primary, then the fallbacks a gateway tries in order."""
    max_in_flight: int = 4096
    """Requests this picker has chosen for and not seen end; past it a request is shed (429)."""
    lease_ttl_s: float = 10.0
    """Life of this picker's lease on its requests in flight, renewed every third of it."""
    drain_timeout_s: float = 30.0
    """On SIGTERM or SIGINT, how long the streams open may finish."""
    head_first: bool = True
    """A long prompt whose start no replica holds is chosen for once its head (a few blocks)
    is tokenized, the rest after the answer; false: every prompt is tokenized whole first."""

    def __post_init__(self) -> None:
        for name in ("lease_ttl_s", "drain_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise SettingsError(f"picker.{name} must be a number, got {value!r}")
            if not 0 < value < float("inf"):
                raise SettingsError(f"picker.{name} must be a finite number > 0, got {value!r}")
        for name, low in (("port", 1), ("metrics_port", -1), ("num_endpoints", 1)):
            _check_int(name, getattr(self, name), low, 65535)
        _check_int("max_in_flight", self.max_in_flight, 1, 2**31)
        if not isinstance(self.head_first, bool):
            raise SettingsError(f"picker.head_first must be true or false, got {self.head_first!r}")


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SettingsError(f"picker.{name} must be an integer in [{low}, {high}], got {value!r}")


ENV_PREFIX = "KVINDEX_PICKER_"
"""Every PickerSettings field ``f`` is read from ``KVINDEX_PICKER_<F>``."""
_FIELD_TYPES = {f.name: str(f.type) for f in fields(PickerSettings)}


def load_picker_settings(
    values: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> PickerSettings:
    """Defaults < TOML ``[picker]`` < ``KVINDEX_PICKER_*`` env < ``overrides`` (None ignored)."""
    if values is not None and not isinstance(values, Mapping):
        raise SettingsError(f"[picker] must be a table, got {values!r}")
    raw = dict(values or {})
    unknown = sorted(set(raw) - set(_FIELD_TYPES))
    if unknown:
        raise SettingsError(f"[picker]: unknown settings {unknown} (known: {sorted(_FIELD_TYPES)})")
    from_env = _from_env(os.environ if env is None else env)
    try:
        return PickerSettings(**layered(raw, from_env, overrides))
    except SettingsError as exc:
        blamed = [ENV_PREFIX + k.upper() for k in from_env if f"picker.{k} " in f"{exc} "]
        raise SettingsError(f"{exc} (set by {blamed[0]})" if blamed else str(exc)) from None


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for variable in sorted(n for n in environ if n.startswith(ENV_PREFIX) and environ[n]):
        key = variable.removeprefix(ENV_PREFIX).lower()
        if key not in _FIELD_TYPES:
            known = [ENV_PREFIX + n.upper() for n in sorted(_FIELD_TYPES)]
            raise SettingsError(f"{variable}: no such picker setting (known: {known})")
        found[key] = from_env_text(variable, environ[variable], _FIELD_TYPES[key])
    return found


def picker_settings_of(
    file: ConfigFile,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> PickerSettings:
    return load_picker_settings(file.table("picker"), env=env, overrides=overrides)
