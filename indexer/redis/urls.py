"""Redis URLs as the settings give them, without the Redis client (cluster seeds and modes)."""

from __future__ import annotations

from typing import Literal, get_args

ClusterMode = Literal["auto", "on", "off"]
CLUSTER_MODES: tuple[str, ...] = get_args(ClusterMode)


def seeds_of(url: str) -> list[str]:
    """The URLs a ``redis_url`` names (comma-separated seeds of one cluster, or one URL)."""
    return [part.strip() for part in url.split(",") if part.strip()]


def safe_url(url: str) -> str:
    """``url`` (or comma-separated URLs) without credentials: what logs and errors show."""
    return ",".join(_safe(seed) for seed in seeds_of(url))


def _safe(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url
