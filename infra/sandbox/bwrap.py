"""bubblewrap runtime: a warm runner inside ``bwrap`` namespaces (no daemon needed).

Each sandbox is one ``bwrap`` process: new user, PID, network, IPC, UTS, mount and cgroup
namespaces (``--unshare-all``; the network namespace has only a loopback), no nested user
namespaces, all capabilities dropped, the runner as PID 1, a read-only root made of either the
host's ``/usr`` or a separate rootfs (``sandbox.rootfs``, e.g. the debootstrap tree that
``scripts/setup_sandbox.sh`` builds), a size-capped tmpfs at ``/scratch``, a read-only ``/dev`` with
only the harmless nodes, a cleared environment. Started by root, bwrap itself runs as
``sandbox.uid`` (65534, "nobody"), so the sandbox's processes are unprivileged on the host too.

What it does NOT isolate (see docs/sandbox.md): no cgroup, so memory is limited per process
(RLIMIT_AS) and the total is at most ``pids × memory_mb``; CPU is bounded only in time
(RLIMIT_CPU + the wall-clock timeout), not in share; the kernel is shared (a kernel exploit escapes).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
from typing import Any

from infra.config import SandboxConfig
from infra.sandbox.handle import PipeTransport, RunnerHandle, start_runner
from infra.sandbox.protocol import runner_argv
from infra.sandbox.types import SandboxError, SandboxUnusable

_ids = itertools.count(1)
# MALLOC_ARENA_MAX: each glibc arena reserves 64 MiB of address space, which RLIMIT_AS counts.
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/scratch", "TMPDIR": "/scratch", "LANG": "C.UTF-8", "MALLOC_ARENA_MAX": "2"}


def runner_opts(cfg: SandboxConfig) -> dict[str, Any]:
    """Limits and paths the in-sandbox runner enforces (see runner.py)."""
    return {
        "scratch": "/scratch",
        "wipe": ["/scratch"],
        "memory_bytes": cfg.memory_mb << 20,
        "nproc": cfg.pids,
        "fsize_bytes": cfg.scratch_mb << 20,
        "nofile": 256,
        "output_limit": cfg.output_limit_bytes,
        "tail_bytes": cfg.tail_bytes,
    }


def _root_args(cfg: SandboxConfig) -> list[str]:
    if cfg.rootfs:
        if not os.path.isdir(os.path.join(cfg.rootfs, "scratch")):
            raise SandboxUnusable(
                f"sandbox.rootfs {cfg.rootfs!r} has no /scratch folder (run scripts/setup_sandbox.sh)")
        return ["--ro-bind", cfg.rootfs, "/"]
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args


def bwrap_argv(cfg: SandboxConfig, mode: str = "--runner", job: dict[str, Any] | None = None) -> list[str]:
    """The full bwrap command line for a runner (or a one-job sandbox)."""
    bwrap = shutil.which(cfg.bwrap_path) or cfg.bwrap_path
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--as-pid-1", "--uid", str(cfg.uid), "--gid", str(cfg.uid),
            "--hostname", "sandbox"]
    if os.geteuid() == 0 and cfg.uid == 0:
        argv += ["--cap-drop", "ALL"]
    argv += _root_args(cfg)
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(cfg.scratch_mb << 20), "--tmpfs", "/scratch",
             "--remount-ro", "/", "--remount-ro", "/dev", "--clearenv"]
    for key, value in ENV.items():
        argv += ["--setenv", key, value]
    argv += ["--chdir", "/"]
    python = cfg.python if not cfg.rootfs else "/usr/bin/python3"
    argv += runner_argv(python, mode, runner_opts(cfg))
    if job is not None:
        argv.append(json.dumps(job))
    return argv


def _host_user(cfg: SandboxConfig) -> int | None:
    """Run bwrap itself as ``cfg.uid`` when we are root (so nothing in it is root on the host)."""
    return cfg.uid if os.geteuid() == 0 and cfg.uid != 0 else None


class BwrapRuntime:
    """Spawns bwrap sandboxes; see the module docstring for the isolation it gives."""

    name = "bwrap"

    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        if shutil.which(cfg.bwrap_path) is None:
            raise SandboxUnusable(f"bubblewrap not found ({cfg.bwrap_path!r}); run scripts/setup_sandbox.sh")
        if not cfg.rootfs and not os.path.exists(cfg.python):
            raise SandboxUnusable(f"sandbox.python {cfg.python!r} does not exist on this host")

    def spawn(self) -> RunnerHandle:
        """Start one warm sandbox and wait until its runner is ready."""
        argv = bwrap_argv(self.cfg)
        try:
            transport = PipeTransport(argv, env={"PATH": "/usr/bin:/bin"}, user=_host_user(self.cfg))
        except OSError as exc:  # fork/exec failed (no memory, process limit): the host's, not a job's
            raise SandboxError(f"bwrap could not be started: {exc}") from exc
        try:
            return start_runner(transport, f"bwrap-{os.getpid()}-{next(_ids)}", self.cfg.start_timeout_s)
        except Exception as exc:
            raise SandboxError(f"bwrap sandbox did not start: {exc}") from exc

    def naive(self, job: dict[str, Any]) -> dict[str, Any]:
        """Run one job in a brand-new bwrap sandbox (the no-pool baseline)."""
        proc = subprocess.run(
            bwrap_argv(self.cfg, "--oneshot", job),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env={"PATH": "/usr/bin:/bin"},
            timeout=float(job["timeout"]) + 30,
            user=_host_user(self.cfg),
            group=_host_user(self.cfg),
            extra_groups=[] if _host_user(self.cfg) is not None else None,
        )
        return json.loads(proc.stdout.splitlines()[-1])

    def close(self) -> None:
        """Nothing shared to release (each sandbox dies with its handle)."""
