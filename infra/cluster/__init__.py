"""Cluster providers: bring up the trainer's process group (N ranks) on some machines.

A provider is selected by ``cluster.type`` through :func:`create_provider`. Each provider launches a
Python module under ``torch.distributed.run`` (torchrun) on its machines and returns a
:class:`~infra.cluster.base.GroupHandle` that can be polled and torn down. Providers are listed in
:data:`PROVIDERS` by ``module:class`` and imported only when chosen (one module per provider).
"""

from __future__ import annotations

from typing import Callable

from infra.backends import Registry
from infra.cluster.base import ClusterProvider, GroupHandle
from infra.config import ClusterConfig

PROVIDERS: Registry[ClusterProvider] = Registry("cluster provider", {
    "local": "infra.cluster.local:LocalProvider",
    "hosts": "infra.cluster.hosts:HostsProvider",
    "kubernetes": "infra.cluster.kubernetes:KubernetesProvider",
})


def register_provider(name: str, factory: Callable[[ClusterConfig], ClusterProvider] | str) -> None:
    """Register a provider factory (or a lazy ``"module:attr"``) under ``name`` (a ``cluster.type``)."""
    PROVIDERS.add(name, factory)


def create_provider(cfg: ClusterConfig) -> ClusterProvider:
    """Instantiate the provider named by ``cfg.type``; unknown names raise ``ValueError``."""
    return PROVIDERS.create(cfg.type, cfg)


__all__ = ["PROVIDERS", "ClusterProvider", "GroupHandle", "create_provider", "register_provider"]
