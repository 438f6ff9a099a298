"""The provider protocol and the handles shared by every provider.

A provider starts two kinds of things: the trainer's group of ranks under torchrun
(:meth:`ClusterProvider.launch` -> :class:`GroupHandle`) and a single service process such as the
rollout worker (:meth:`ClusterProvider.launch_service` -> :class:`ServiceHandle`, from an
:class:`infra.proc.ServiceSpec`). Both are placed by the provider, so both can run on another host.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from typing import Protocol

from infra.errors import DeltaloopError
from infra.proc import ServiceSpec, stop_processes


class ClusterError(DeltaloopError):
    """Provisioning or a running group failed. ``retryable``: may a fresh attempt help?"""

    retryable = True


class GroupHandle(Protocol):
    """A launched group of ranks."""

    master_addr: str

    def poll(self) -> int | None:
        """None while every rank's launcher runs; else the first non-zero (or 0) exit code."""

    def terminate(self, timeout: float = 10.0) -> None:
        """Stop every rank and its children (SIGTERM, then SIGKILL). Idempotent."""

    def describe(self) -> str:
        """Human description (hosts, pids) for errors and logs."""


class ServiceHandle(Protocol):
    """One launched service process (:meth:`ClusterProvider.launch_service`)."""

    host: str  # address the flow reaches the service at (the host the provider placed it on)
    logs: list[str]  # log files on this host

    def poll(self) -> int | None:
        """None while it runs; else its exit code."""

    def terminate(self, timeout: float = 10.0) -> object:
        """Stop it and its children (SIGTERM, then SIGKILL). Idempotent."""

    def describe(self) -> str:
        """Human description (host, pid, state, log) for errors and logs."""


class ClusterProvider(Protocol):
    """Launches ``python -m MODULE ARGS`` on ``world_size`` ranks under torchrun, and single services."""

    world_size: int

    def launch(self, module: str, args: list[str], env: dict[str, str], log_dir: str) -> GroupHandle:
        """Start the ranks; logs go to ``log_dir``. Returns immediately."""

    def launch_service(self, spec: ServiceSpec) -> ServiceHandle:
        """Start one process from ``spec`` on a host of the provider's choosing; its output goes to
        ``spec.log`` on this host. Returns immediately; ``handle.host`` says where it runs."""


def group_exit_code(codes: list[int | None]) -> int | None:
    """Exit status of a group from its members' ``poll()`` codes: the first failure at once, 0 when
    every member succeeded, None while any still runs (and none failed)."""
    bad = [c for c in codes if c not in (None, 0)]
    if bad:
        return bad[0]
    return 0 if codes and all(c == 0 for c in codes) else None


@dataclass
class PopenGroup:
    """A group made of local child processes, each leading its own process group."""

    procs: list[subprocess.Popen]
    master_addr: str = "127.0.0.1"
    logs: list[str] = field(default_factory=list)

    def poll(self) -> int | None:
        return group_exit_code([p.poll() for p in self.procs])

    def terminate(self, timeout: float = 10.0) -> None:
        """Stop every member's process tree (torchrun and its ranks)."""
        stop_processes(self.procs, grace=timeout)

    def describe(self) -> str:
        return ", ".join(f"pid {p.pid}" for p in self.procs) + (f" (logs: {', '.join(self.logs)})" if self.logs else "")
