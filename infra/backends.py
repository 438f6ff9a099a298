"""One registry idiom for every pluggable backend (cluster providers, rollout engines, sandbox
runtimes, train engines, object stores, benchmarks).

A :class:`Registry` maps the name a config field selects (``cluster.type``, ``rollout.type``,
``sandbox.runtime``, ``trainer.engine``...) to a factory. A factory is either a callable or a lazy
``"package.module:attr"`` string that is imported only when that backend is chosen, so a heavy or
optional backend (DeepSpeed, Kubernetes, vLLM, docker) costs nothing until used, and a backend
module never has to import the registry that names it (no import cycle)::

    PROVIDERS: Registry[ClusterProvider] = Registry("cluster provider", {
        "local": "infra.cluster.local:LocalProvider",
        "hosts": "infra.cluster.hosts:HostsProvider",
    })
    provider = PROVIDERS.create(cfg.type, cfg)

An unknown name raises ``ValueError`` listing the known ones.

This module is a leaf: it imports nothing from the project.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Generic, Iterator, Mapping, TypeVar, Union

T = TypeVar("T")

Factory = Union[Callable[..., T], str]


def _resolve(ref: str) -> Callable[..., Any]:
    """Import ``"package.module:attr"`` and return the attribute (``attr`` may be dotted: ``Class.method``)."""
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"backend reference {ref!r} must look like 'package.module:attr'")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    """Named factories of one kind of backend; ``create(name, ...)`` builds the chosen one.

    ``kind`` names the backend family in error messages (``"unknown cluster provider 'x'; known:
    hosts, local"``).
    """

    def __init__(self, kind: str, entries: Mapping[str, Factory[T]] | None = None) -> None:
        self.kind = kind
        self._entries: dict[str, Factory[T]] = dict(entries or {})

    def add(self, name: str, factory: Factory[T]) -> None:
        """Register ``factory`` (a callable, or a lazy ``"module:attr"`` string) under ``name``."""
        self._entries[name] = factory

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator form of :meth:`add`: ``@REGISTRY.register("name")`` over a class or function."""

        def deco(factory: Callable[..., T]) -> Callable[..., T]:
            self.add(name, factory)
            return factory

        return deco

    def get(self, name: str) -> Callable[..., T]:
        """The factory registered under ``name`` (imported now if it was lazy)."""
        try:
            factory = self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}") from None
        return _resolve(factory) if isinstance(factory, str) else factory

    def create(self, name: str, *args: Any, **kwargs: Any) -> T:
        """Build the backend named ``name`` with ``factory(*args, **kwargs)``."""
        return self.get(name)(*args, **kwargs)

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)


__all__ = ["Registry"]
