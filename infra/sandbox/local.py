"""unsafe_local runtime: the runner as a plain local subprocess — NO isolation.

For hosts with neither bubblewrap nor Docker, and for debugging. The job still gets rlimits
(memory, CPU, file size, fds), a scratch folder that is wiped between jobs, a cleared environment
and its own process group, but it runs as *your* user with *your* network and filesystem, and
processes that leave their process group survive. Selecting it needs ``allow_unsandboxed: true``
and every pool start warns loudly.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from typing import Any

from infra.config import SandboxConfig
from infra.sandbox.handle import PipeTransport, RunnerHandle, start_runner
from infra.sandbox.protocol import runner_argv
from infra.sandbox.types import SandboxError, SandboxUnusable

_ids = itertools.count(1)
WARNING = (
    "sandbox.runtime=unsafe_local runs untrusted model output WITHOUT ISOLATION "
    "(your user, your network, your files). Use bwrap or docker for anything but debugging."
)


class LocalRuntime:
    """Runner subprocesses on this host, each with its own scratch folder."""

    name = "unsafe_local"

    def __init__(self, cfg: SandboxConfig) -> None:
        if not cfg.allow_unsandboxed:
            raise SandboxUnusable("unsafe_local needs sandbox.allow_unsandboxed: true")
        warnings.warn(WARNING, RuntimeWarning, stacklevel=3)
        print(f"WARNING: {WARNING}", file=sys.stderr)
        self.cfg = cfg
        self.python = cfg.python if os.path.exists(cfg.python) else sys.executable
        self.root = tempfile.mkdtemp(prefix="deltaloop-unsafe-")

    def _opts(self, scratch: str) -> dict[str, Any]:
        return {
            "scratch": scratch,
            "wipe": [scratch],
            "memory_bytes": self.cfg.memory_mb << 20,
            "nproc": None,
            "fsize_bytes": self.cfg.scratch_mb << 20,
            "nofile": 256,
            "output_limit": self.cfg.output_limit_bytes,
            "tail_bytes": self.cfg.tail_bytes,
        }

    def spawn(self) -> RunnerHandle:
        """Start one local runner."""
        n = next(_ids)
        scratch = os.path.join(self.root, f"s{n}")
        os.makedirs(scratch, mode=0o700)
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8", "MALLOC_ARENA_MAX": "2"}
        try:
            transport = PipeTransport(runner_argv(self.python, "--runner", self._opts(scratch)), env=env)
        except OSError as exc:
            raise SandboxError(f"local runner could not be started: {exc}") from exc
        try:
            return start_runner(transport, f"local-{os.getpid()}-{n}", self.cfg.start_timeout_s)
        except Exception as exc:
            raise SandboxError(f"local runner did not start: {exc}") from exc

    def naive(self, job: dict[str, Any]) -> dict[str, Any]:
        """One job in a fresh local process."""
        scratch = tempfile.mkdtemp(dir=self.root)
        try:
            proc = subprocess.run(runner_argv(self.python, "--oneshot", self._opts(scratch)) + [json.dumps(job)],
                                  capture_output=True, stdin=subprocess.DEVNULL, timeout=float(job["timeout"]) + 30,
                                  env={"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch})
            return json.loads(proc.stdout.splitlines()[-1])
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def close(self) -> None:
        """Remove the scratch folders."""
        shutil.rmtree(self.root, ignore_errors=True)
