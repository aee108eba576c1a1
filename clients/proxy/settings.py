"""The proxy's own settings: how requests are forwarded (from the ``kvindex proxy`` options).

The read path's settings stay where they are (``[api]`` and ``[[models]]`` of ``--config``
for scoring and tokenizers, the top-level indexer keys for the write path).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvindex.indexer.errors import SettingsError


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """How the proxy forwards; every field defaulted, validated on construction (errors
    name the ``proxy.*`` key and the bad value)."""

    connect_timeout_s: float = 2.0
    """Longest wait for a connection to a replica; past it the next replica is tried."""
    first_byte_timeout_s: float = 300.0
    """Longest wait for a replica's answer to start (a non-streaming vLLM answer starts
    when generation ends, so keep it generous). It also bounds each wait between two
    chunks of a stream (httpx's read timeout)."""
    total_timeout_s: float = 900.0
    """Longest time one request may take, attempts and stream included; a stream cut by
    it ends early (the client sees an incomplete body)."""
    max_attempts: int = 3
    """Replicas tried at most per request (1: no retry). Retries happen only before the
    first byte reaches the client, on a connect error or a 502, 503 or 504."""
    max_connections: int = 1024
    """Connections to one replica at once (its HTTP client's pool)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM or SIGINT the proxy stops accepting connections and lets the requests it
    is answering (streams included) finish for at most this long (rounded up to whole
    seconds), then stops."""

    def __post_init__(self) -> None:
        for name in (
            "connect_timeout_s",
            "first_byte_timeout_s",
            "total_timeout_s",
            "drain_timeout_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise SettingsError(f"proxy.{name} must be a number > 0, got {value!r}")
        for name in ("max_attempts", "max_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SettingsError(f"proxy.{name} must be an integer >= 1, got {value!r}")


def load_proxy_settings(values: Mapping[str, Any]) -> ProxySettings:
    """The defaults, with ``values`` over them (None values ignored); unknown keys and bad
    values are :class:`SettingsError` naming them."""
    values = {k: v for k, v in values.items() if v is not None}
    known = {f.name for f in fields(ProxySettings)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise SettingsError(f"proxy: unknown keys {unknown} (known: {sorted(known)})")
    return ProxySettings(**values)
