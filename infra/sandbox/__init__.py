"""Sandboxed execution and scoring of untrusted model output.

``create_pool(cfg)`` picks the runtime named by ``sandbox.runtime`` and returns a
:class:`SandboxPool` that keeps warm sandboxes ready::

    with create_pool(cfg.sandbox) as pool:
        results = pool.verify_many([VerifyRequest(program, "f", [TestCase([1], 5)])])

Runtimes (one module each): ``bwrap`` (bubblewrap namespaces, no daemon), ``docker`` (docker SDK,
one or more daemons), ``unsafe_local`` (no isolation; needs ``allow_unsandboxed``). How a job is
isolated, reset and scored is described in ``runner.py`` and ``docs/sandbox.md``.
"""

from __future__ import annotations

from typing import Callable

from infra.config import SandboxConfig
from infra.sandbox.pool import Runtime, SandboxPool
from infra.sandbox.types import (
    REASONS,
    ExecResult,
    SandboxError,
    TestCase,
    VerifyRequest,
    VerifyResult,
)


def _bwrap(cfg: SandboxConfig) -> Runtime:
    from infra.sandbox.bwrap import BwrapRuntime

    return BwrapRuntime(cfg)


def _docker(cfg: SandboxConfig) -> Runtime:
    from infra.sandbox.docker_rt import DockerRuntime

    return DockerRuntime(cfg)


def _local(cfg: SandboxConfig) -> Runtime:
    from infra.sandbox.local import LocalRuntime

    return LocalRuntime(cfg)


RUNTIMES: dict[str, Callable[[SandboxConfig], Runtime]] = {
    "bwrap": _bwrap,
    "docker": _docker,
    "unsafe_local": _local,
}


def create_runtime(cfg: SandboxConfig) -> Runtime:
    """The runtime named by ``cfg.runtime``; unknown names raise ``ValueError`` listing the known ones."""
    try:
        factory = RUNTIMES[cfg.runtime]
    except KeyError:
        raise ValueError(f"unknown sandbox runtime {cfg.runtime!r}; known: {', '.join(sorted(RUNTIMES))}") from None
    return factory(cfg)


def create_pool(cfg: SandboxConfig) -> SandboxPool:
    """A (not yet started) pool over the configured runtime. Raises SandboxError if it is unusable."""
    return SandboxPool(cfg, create_runtime(cfg))


__all__ = [
    "REASONS",
    "ExecResult",
    "SandboxError",
    "SandboxPool",
    "TestCase",
    "VerifyRequest",
    "VerifyResult",
    "create_pool",
    "create_runtime",
]
