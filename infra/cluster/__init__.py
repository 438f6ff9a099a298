"""Cluster providers: bring up the trainer's process group (N ranks) on some machines.

A provider is selected by ``cluster.type`` through :func:`create_provider`. Each provider launches a
Python module under ``torch.distributed.run`` (torchrun) on its machines and returns a
:class:`~infra.cluster.base.GroupHandle` that can be polled and torn down.
"""

from __future__ import annotations

from typing import Callable

from infra.cluster.base import ClusterProvider, GroupHandle
from infra.config import ClusterConfig

_PROVIDERS: dict[str, Callable[[ClusterConfig], ClusterProvider]] = {}


def register_provider(name: str, factory: Callable[[ClusterConfig], ClusterProvider]) -> None:
    """Register a provider factory under ``name`` (the value of ``cluster.type``)."""
    _PROVIDERS[name] = factory


def create_provider(cfg: ClusterConfig) -> ClusterProvider:
    """Instantiate the provider named by ``cfg.type``; unknown names raise ``ValueError``."""
    _load_builtin()
    try:
        factory = _PROVIDERS[cfg.type]
    except KeyError:
        raise ValueError(f"unknown cluster provider {cfg.type!r}; known: {', '.join(sorted(_PROVIDERS))}") from None
    return factory(cfg)


def _load_builtin() -> None:
    import importlib

    for mod in ("local", "hosts", "kubernetes"):
        try:
            importlib.import_module(f"infra.cluster.{mod}")
        except ModuleNotFoundError as exc:
            if exc.name != f"infra.cluster.{mod}":
                raise


__all__ = ["ClusterProvider", "GroupHandle", "create_provider", "register_provider"]
