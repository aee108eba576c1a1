"""Pods as replicas: the Kubernetes objects' fields kvindex reads (msgspec, the rest ignored)
and :func:`replicas_of`, a routable pod's ports → one :class:`ReplicaSpec` each. No I/O."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import msgspec

from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.fleet.replica import ReplicaSpec

MODEL_KEY = "kvindex.io/model"  # annotation (or label): the served model
EVENTS_PORT_KEY = "kvindex.io/events-port"  # annotation: rank 0's PUB port, rank r's is it + r
REPLAY_PORT_KEY = "kvindex.io/replay-port"  # annotation: rank 0's replay port (absent: none)
DEFAULT_EVENTS_PORT = 5557  # vLLM's KVEventsConfig.endpoint; vLLM has no default replay port


class PodError(KvIndexError):
    """A pod whose annotations or address cannot make replicas."""


class ObjectMeta(msgspec.Struct, frozen=True):
    name: str = ""
    namespace: str = ""
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    resource_version: str = msgspec.field(default="", name="resourceVersion")
    deletion_timestamp: str | None = msgspec.field(default=None, name="deletionTimestamp")


class PodCondition(msgspec.Struct, frozen=True):
    type: str = ""
    status: str = ""


class PodStatus(msgspec.Struct, frozen=True):
    pod_ip: str = msgspec.field(default="", name="podIP")
    phase: str = ""
    conditions: list[PodCondition] = []


class Pod(msgspec.Struct, frozen=True):
    metadata: ObjectMeta = ObjectMeta()
    status: PodStatus = PodStatus()


class ListMeta(msgspec.Struct, frozen=True):
    resource_version: str = msgspec.field(default="", name="resourceVersion")


class PodList(msgspec.Struct, frozen=True):
    metadata: ListMeta = ListMeta()
    items: list[Pod] = []


class WatchEvent(msgspec.Struct, frozen=True):  # ADDED, MODIFIED, DELETED, BOOKMARK; ERROR
    type: str
    object: msgspec.Raw = msgspec.Raw(b"{}")


class Status(msgspec.Struct, frozen=True):  # an ERROR event's object
    code: int = 0
    reason: str = ""
    message: str = ""


class LabelSelector(msgspec.Struct, frozen=True):
    match_labels: dict[str, str] = msgspec.field(default={}, name="matchLabels")


class TargetPort(msgspec.Struct, frozen=True):
    number: int = 0


class PoolSpec(msgspec.Struct, frozen=True):
    selector: LabelSelector = LabelSelector()
    target_ports: list[TargetPort] = msgspec.field(default=[], name="targetPorts")


class InferencePool(msgspec.Struct, frozen=True):
    spec: PoolSpec = PoolSpec()


@dataclass(frozen=True, slots=True)
class Target:  # the pods (a label selector) and their serving ports, rank by rank
    selector: str
    ports: tuple[int, ...]


def pool_target(pool: InferencePool) -> Target:
    """The pods and ports an InferencePool names; PodError if it selects nothing definite."""
    labels = pool.spec.selector.match_labels
    ports = tuple(p.number for p in pool.spec.target_ports)
    if not labels:
        raise PodError("the InferencePool has no spec.selector.matchLabels")
    if not 1 <= len(ports) <= 8 or not all(0 < p < 65536 for p in ports):
        raise PodError(f"the InferencePool's spec.targetPorts must be 1 to 8 ports, got {ports}")
    return Target(",".join(f"{k}={v}" for k, v in sorted(labels.items())), ports)


def routable(pod: Pod) -> bool:
    """Ready, addressed and not being deleted: the pods a gateway would send requests to."""
    if pod.metadata.deletion_timestamp is not None or not pod.status.pod_ip:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions)


def replica_id(pod_name: str, rank: int) -> str:
    """``<pod>`` for rank 0, ``<pod>-<rank>`` for the others."""
    return pod_name if rank == 0 else f"{pod_name}-{rank}"


def replicas_of(pod: Pod, ports: tuple[int, ...], default_model: str) -> tuple[ReplicaSpec, ...]:
    """One replica per port of a routable pod (none otherwise): rank r serves on ``ports[r]``,
    publishes on the events port + r and replays on the replay port + r."""
    if not routable(pod):
        return ()
    meta = pod.metadata
    model = meta.annotations.get(MODEL_KEY) or meta.labels.get(MODEL_KEY) or default_model
    if not model:
        raise PodError(f"pod {meta.name}: no {MODEL_KEY} annotation or label, and no default")
    host = _host(meta.name, pod.status.pod_ip)
    events = _port(meta, EVENTS_PORT_KEY, len(ports)) or DEFAULT_EVENTS_PORT
    replay = _port(meta, REPLAY_PORT_KEY, len(ports))
    try:
        return tuple(
            ReplicaSpec(
                replica_id(meta.name, rank),
                model,
                events=f"tcp://{host}:{events + rank}",
                replay=_ranked(host, replay, rank),
                url=f"http://{host}:{port}",
            )
            for rank, port in enumerate(ports)
        )
    except KvIndexError as exc:  # a name or model a replica cannot take
        raise PodError(f"pod {meta.name}: {exc}") from None


def _ranked(host: str, port: int | None, rank: int) -> str | None:
    return None if port is None else f"tcp://{host}:{port + rank}"


def _host(name: str, ip: str) -> str:
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        raise PodError(f"pod {name}: status.podIP {ip!r} is not an IP address") from None
    return f"[{address}]" if address.version == 6 else str(address)


def _port(meta: ObjectMeta, key: str, num_ranks: int) -> int | None:
    """The annotation's port (None when absent), with room for every rank's."""
    text = meta.annotations.get(key)
    if text is None:
        return None
    if not text.strip().isdigit() or not 0 < int(text) <= 65536 - num_ranks:
        raise PodError(f"pod {meta.name}: annotation {key} must be a port, got {text!r}")
    return int(text)
