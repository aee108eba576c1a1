"""Endpoints as a gateway names them (``ip:port`` of a replica's ``url``) and its subset hint."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from kvindex.indexer.fleet.replica import ReplicaSpec

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
DESTINATION_NAMESPACE = "envoy.lb"
DESTINATION_KEY = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
_DEFAULT_PORTS = {"http": 80, "https": 443}


def endpoint_of(url: str | None) -> str | None:
    """``host:port`` of ``url`` (``[v6]:port`` for IPv6; the scheme's port when none is
    written); None when there is no usable url."""
    if not url:
        return None
    try:
        parts = urlsplit(url)
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return None
    host = parts.hostname
    if not host or port is None:
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class EndpointBook:
    """Replica id ↔ endpoint, remade when the specs change (compared as the scorer does)."""

    def __init__(self) -> None:
        self._specs: list[ReplicaSpec] | None = None
        self.replica_to_endpoint: dict[str, str] = {}
        self.endpoint_to_replica: dict[str, str] = {}

    def update(self, specs: list[ReplicaSpec]) -> EndpointBook:
        if self._specs is not None and self._specs == specs:
            self._specs = specs  # equal but perhaps new objects: compared by identity next
            return self
        named = ((r.id, endpoint_of(r.url)) for r in specs)
        self.replica_to_endpoint = {rid: e for rid, e in named if e is not None}
        self.endpoint_to_replica = {e: rid for rid, e in self.replica_to_endpoint.items()}
        self._specs = specs
        return self


def subset_of(metadata: Any) -> frozenset[str] | None:
    """The endpoints of the gateway's subset hint in ``metadata`` (an ext_proc request's
    ``metadata_context``); None: no hint, every endpoint may serve. The hint is a list of
    strings or one comma-separated string."""
    structs = metadata.filter_metadata
    if SUBSET_NAMESPACE not in structs or SUBSET_KEY not in structs[SUBSET_NAMESPACE].fields:
        return None
    return frozenset(endpoints_in(structs[SUBSET_NAMESPACE].fields[SUBSET_KEY]))


def endpoints_in(value: Any) -> list[str]:
    """The ``ip:port`` strings a ``google.protobuf.Value`` holds (anything else ignored)."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return [e.strip() for e in value.string_value.split(",") if e.strip()]
    if kind == "list_value":
        return [e for v in value.list_value.values for e in endpoints_in(v)]
    return []


def served_in(metadata: Any) -> str | None:
    """The endpoint the gateway reports as the one that served (None: not reported)."""
    structs = metadata.filter_metadata
    if DESTINATION_NAMESPACE not in structs:
        return None
    fields = structs[DESTINATION_NAMESPACE].fields
    found = endpoints_in(fields[SERVED_KEY]) if SERVED_KEY in fields else []
    return found[0] if found else None
