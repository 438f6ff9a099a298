"""Sandboxed execution and scoring of untrusted model output.

``create_pool(cfg)`` picks the runtime named by ``sandbox.runtime`` and returns a
:class:`SandboxPool` that keeps warm sandboxes ready::

    with create_pool(cfg.sandbox) as pool:
        results = pool.verify_many([VerifyRequest(program, "f", [TestCase([1], 5)])])
        verdicts = pool.run_tests_many([TestsRequest(program, "assert f(1) == 5\n", entry="f")])

Runtimes (one module each): ``bwrap`` (bubblewrap namespaces, no daemon), ``docker`` (docker SDK,
one or more daemons), ``unsafe_local`` (no isolation; needs ``allow_unsandboxed``). How a job is
isolated, reset and scored is described in ``runner.py`` and ``docs/sandbox.md``.
"""

from __future__ import annotations

from infra.backends import Registry
from infra.config import SandboxConfig
from infra.sandbox.pool import Runtime, SandboxPool
from infra.sandbox.types import (
    REASONS,
    ExecResult,
    SandboxError,
    SandboxUnusable,
    TestCase,
    TestsRequest,
    TestsResult,
    VerifyRequest,
    VerifyResult,
)

#: ``sandbox.runtime`` -> runtime class, imported only when chosen.
RUNTIMES: Registry[Runtime] = Registry("sandbox runtime", {
    "bwrap": "infra.sandbox.bwrap:BwrapRuntime",
    "docker": "infra.sandbox.docker_rt:DockerRuntime",
    "unsafe_local": "infra.sandbox.local:LocalRuntime",
})


def create_runtime(cfg: SandboxConfig) -> Runtime:
    """The runtime named by ``cfg.runtime``; unknown names raise ``ValueError`` listing the known ones."""
    return RUNTIMES.create(cfg.runtime, cfg)


def create_pool(cfg: SandboxConfig) -> SandboxPool:
    """A (not yet started) pool over the configured runtime. Raises SandboxError if it is unusable."""
    return SandboxPool(cfg, create_runtime(cfg))


__all__ = [
    "REASONS",
    "RUNTIMES",
    "ExecResult",
    "SandboxError",
    "SandboxPool",
    "SandboxUnusable",
    "TestCase",
    "TestsRequest",
    "TestsResult",
    "VerifyRequest",
    "VerifyResult",
    "create_pool",
    "create_runtime",
]
