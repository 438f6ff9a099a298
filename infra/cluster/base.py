"""The provider protocol and the process-group handle shared by every provider."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Protocol

from infra.errors import DeltaloopError


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


class ClusterProvider(Protocol):
    """Launches ``python -m MODULE ARGS`` on ``world_size`` ranks under torchrun."""

    world_size: int

    def launch(self, module: str, args: list[str], env: dict[str, str], log_dir: str) -> GroupHandle:
        """Start the ranks; logs go to ``log_dir``. Returns immediately."""


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
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
                time.sleep(0.05)
            if all(p.poll() is not None for p in self.procs):
                break
        # reap stray members of the process groups (ranks spawned by torchrun)
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def describe(self) -> str:
        return ", ".join(f"pid {p.pid}" for p in self.procs) + (f" (logs: {', '.join(self.logs)})" if self.logs else "")


def free_port() -> int:
    """An unused TCP port on loopback."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
