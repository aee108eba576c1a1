"""One vLLM replica as kvindex knows it (:class:`ReplicaSpec`); every way a spec comes in
validates the same, a bad value raising ``SettingsError`` that names it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

from kvindex.indexer.domain.errors import SettingsError
from kvindex.indexer.redis.schema import SchemaError, check_name

MAX_DP_SIZE = 1024
"""The most data-parallel ranks one replica may declare (each costs two sockets and a lookup)."""


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One vLLM replica (all its data-parallel ranks)."""

    id: str
    """Stable replica id (letters, digits, ``._:-``); the router routes to it."""
    model: str
    """Model name as served (the namespace of its block keys)."""
    events: str | None = None
    """Its PUB endpoint, which the indexer connects to (None: it connects to the bound SUB)."""
    replay: str | None = None
    """Its replay ROUTER endpoint (``replay_endpoint``); None disables gap repair."""
    url: str | None = None
    """Base URL of its OpenAI-compatible server (``/metrics``, ``/tokenize``), http(s)."""
    dp_size: int = 1
    """Data-parallel ranks, 1 to :data:`MAX_DP_SIZE`; rank r publishes on port + r."""

    def __post_init__(self) -> None:
        _check_replica_id(self.id)
        if not self.model:
            raise SettingsError(f"replica {self.id}: model must not be empty")
        if not 1 <= self.dp_size <= MAX_DP_SIZE:
            raise SettingsError(
                f"replica {self.id}: dp_size must be in [1, {MAX_DP_SIZE}], got {self.dp_size}"
            )
        for name in ("events", "replay"):
            check_endpoint(f"replica {self.id}: {name}", getattr(self, name))
        check_url(f"replica {self.id}: url", self.url)

    def events_for_rank(self, rank: int) -> str | None:
        """The PUB endpoint of one data-parallel rank (vLLM adds the rank to the port)."""
        return None if self.events is None else endpoint_for_rank(self.events, rank)

    def replay_for_rank(self, rank: int) -> str | None:
        """The replay ROUTER endpoint of one data-parallel rank."""
        return None if self.replay is None else endpoint_for_rank(self.replay, rank)

    @classmethod
    def parse(cls, text: str) -> ReplicaSpec:
        """``id=r1,model=M,events=tcp://h:5557[,replay=...][,url=...][,dp_size=2]``."""
        values: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                raise SettingsError(f"replica {text!r}: expected key=value, got {part!r}")
            values["dp_size" if key == "dp" else key] = value
        return replica_from_mapping(values, where=f"replica {text!r}")


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """vLLM's ``offset_endpoint_port``: tcp port + rank, inproc name + ``_dp<rank>``."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint.rpartition(":")
        if sep and port.isdigit() and int(port) != 0:
            return f"{host}:{int(port) + rank}"
    raise SettingsError(f"cannot derive the endpoint of rank {rank} from {endpoint!r}")


def replica_from_mapping(values: Mapping[str, Any], *, where: str) -> ReplicaSpec:
    """A spec from loosely typed values; ``where`` names the source in the error."""
    known = {f.name for f in fields(ReplicaSpec)}
    unknown = set(values) - known
    if unknown:
        raise SettingsError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(known)})")
    for required in ("id", "model"):
        if not values.get(required):
            raise SettingsError(f"{where}: {required} is required")
    converted = dict(values)
    if "dp_size" in converted:
        raw = converted["dp_size"]
        try:
            converted["dp_size"] = int(raw)
        except (TypeError, ValueError):
            raise SettingsError(f"dp_size must be an integer, got {raw!r}") from None
    return ReplicaSpec(**converted)


def check_endpoint(name: str, value: str | None) -> None:
    """Reject anything but a ZeroMQ endpoint (``name`` says whose, in the error)."""
    if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise SettingsError(f"{name} must be a ZeroMQ endpoint (tcp://, ipc://), got {value!r}")


def check_url(name: str, value: str | None) -> None:
    """Reject anything but an ``http://`` or ``https://`` URL with a host."""
    if value is None:
        return
    try:
        parts = urlsplit(value)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname)
        valid = valid and (parts.port is None or parts.port > 0)
    except ValueError:  # a bad port or IPv6 literal
        valid = False
    if not valid:
        raise SettingsError(f"{name} must be an http:// or https:// URL with a host, got {value!r}")


def _check_replica_id(value: str) -> None:
    try:
        check_name("replica id", value)
    except SchemaError as exc:
        raise SettingsError(str(exc)) from exc
