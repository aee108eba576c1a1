"""``DiscoverySettings``: where replicas come from on Kubernetes (TOML ``[discovery]``, read by
:mod:`kvindex.indexer.config.discovery`); a bad value is a SettingsError naming its key."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvindex.indexer.domain.errors import SettingsError

MAX_TARGET_PORTS = 8
"""The most ports an InferencePool lists (each a data-parallel rank)."""
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


@dataclass(frozen=True, slots=True)
class DiscoverySettings:
    """Replicas read from the Kubernetes API: an InferencePool's pods, or a label selector's."""

    pool: str = ""
    """InferencePool (``inference.networking.k8s.io/v1``) whose pods are the replicas ("": none)."""
    selector: str = ""
    """Label selector of the pods instead of a pool (``app=vllm,tier=gpu``), with ``ports``."""
    ports: tuple[int, ...] = ()
    """With ``selector``: the pods' serving ports, 1 to 8, one data-parallel rank each."""
    namespace: str = ""
    """Namespace of the pool and pods ("": this pod's own, else ``default``)."""
    model: str = ""
    """Model of a pod with no ``kvindex.io/model`` annotation or label ("": the pod is skipped)."""
    kubeconfig: str = ""
    """Kubeconfig file ("": the pod's service account, else ``KUBECONFIG``, ``~/.kube/config``)."""

    @property
    def enabled(self) -> bool:
        return bool(self.pool or self.selector)

    def __post_init__(self) -> None:
        for name in ("pool", "selector", "namespace", "model", "kubeconfig"):
            if not isinstance(getattr(self, name), str):
                raise SettingsError(
                    f"discovery.{name} must be a string, got {getattr(self, name)!r}"
                )
        if self.pool and self.selector:
            raise SettingsError("discovery.pool and discovery.selector exclude each other")
        if self.pool and not _DNS_NAME.fullmatch(self.pool):
            raise SettingsError(f"discovery.pool must be a Kubernetes name, got {self.pool!r}")
        if self.namespace and not _DNS_LABEL.fullmatch(self.namespace):
            raise SettingsError(f"discovery.namespace must be a DNS label, got {self.namespace!r}")
        _check_ports(self)
        if not self.enabled and (self.model or self.namespace or self.kubeconfig):
            raise SettingsError("discovery.* needs discovery.pool or discovery.selector")


def _check_ports(settings: DiscoverySettings) -> None:
    ports = settings.ports
    if not isinstance(ports, tuple) or not all(
        isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= 65535 for p in ports
    ):
        raise SettingsError(f"discovery.ports must be ports (1-65535), got {ports!r}")
    if len(set(ports)) != len(ports):
        raise SettingsError(f"discovery.ports must be distinct, got {list(ports)}")
    if settings.selector and not 1 <= len(ports) <= MAX_TARGET_PORTS:
        raise SettingsError(
            f"discovery.selector needs 1 to {MAX_TARGET_PORTS} discovery.ports, got {list(ports)}"
        )
    if ports and not settings.selector:
        raise SettingsError("discovery.ports go with discovery.selector (a pool lists its own)")
