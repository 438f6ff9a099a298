"""Docker runtime: a warm runner in a locked-down container, on one or several Docker hosts.

Each sandbox is one container started from ``sandbox.image`` (built offline by
``scripts/setup_sandbox.sh`` or from ``infra/sandbox/image/Dockerfile``) with no network
(``network_mode=none``), a read-only root, a size-capped tmpfs at ``/scratch``, memory (no swap),
pids and CPU limits from cgroups, user 65534, ``no-new-privileges``, every capability dropped, an
empty environment and no logging. The runner is PID 1 of the container and talks to the pool over
the container's attached stdin/stdout, so remote ``DOCKER_HOST`` URLs (``tcp://``, ``ssh://``) work
like the local socket. ``sandbox.docker_hosts`` spreads sandboxes over several daemons.

What it does NOT isolate (see docs/sandbox.md): the kernel is shared (runc, not a VM); the daemon is
root, so anyone who can reach its socket owns the host; the default seccomp/AppArmor profiles are
whatever the daemon applies.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import struct
import threading
import time
import uuid
from typing import Any

from infra.config import SandboxConfig
from infra.lifeline import pid_alive
from infra.sandbox.handle import RunnerHandle, start_runner
from infra.sandbox.protocol import runner_argv
from infra.sandbox.types import SandboxError, SandboxUnusable

_ids = itertools.count(1)
# MALLOC_ARENA_MAX: each glibc arena reserves 64 MiB of address space, which RLIMIT_AS counts.
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/scratch", "TMPDIR": "/scratch", "LANG": "C.UTF-8", "MALLOC_ARENA_MAX": "2"}
LABEL = "org.deltaloop.sandbox"
PYTHON = "/usr/bin/python3"
OVERHEAD_MB = 64  # runner + zygote resident memory on top of the job's limit
STATE_SETTLE_S = 5.0  # how long a dead sandbox's container may still be reported running


def runner_opts(cfg: SandboxConfig) -> dict[str, Any]:
    """Limits the in-container runner enforces itself (the cgroup enforces the rest)."""
    return {
        "scratch": "/scratch",
        "wipe": ["/scratch", "/dev/shm"],
        "memory_bytes": cfg.memory_mb << 20,
        "nproc": None,  # RLIMIT_NPROC counts the uid host-wide under docker: use the pids cgroup
        "fsize_bytes": cfg.scratch_mb << 20,
        "nofile": 256,
        "output_limit": cfg.output_limit_bytes,
        "tail_bytes": cfg.tail_bytes,
    }


def container_kwargs(cfg: SandboxConfig, labels: dict[str, str]) -> dict[str, Any]:
    """Isolation settings shared by warm sandboxes and the naive baseline."""
    import docker

    mem = f"{cfg.memory_mb + cfg.scratch_mb + OVERHEAD_MB}m"
    return {
        "network_mode": "none",
        "read_only": True,
        "tmpfs": {"/scratch": f"rw,nosuid,nodev,size={cfg.scratch_mb}m,mode=1777"},
        "mem_limit": mem,
        "memswap_limit": mem,
        "pids_limit": cfg.pids,
        "nano_cpus": int(cfg.cpus * 1e9),
        "user": f"{cfg.uid}:{cfg.uid}",
        "security_opt": ["no-new-privileges"],
        "cap_drop": ["ALL"],
        "environment": dict(ENV),
        "working_dir": "/",
        "hostname": "sandbox",
        "shm_size": "8m",
        "ipc_mode": "private",
        "ulimits": [docker.types.Ulimit(name="core", soft=0, hard=0)],
        "labels": labels,
    }


class DockerTransport:
    """The attached stdin/stdout of one container (docker's multiplexed stream, stdout frames only)."""

    def __init__(self, container: Any, sock: Any) -> None:
        self.container = container
        self._wrapper = sock
        self.sock: socket.socket = getattr(sock, "_sock", sock)
        self.sock.settimeout(None)
        self._raw = b""
        self._killed = False
        self._lock = threading.Lock()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_some(self, timeout: float) -> bytes | None:
        out = bytearray()
        while not out:
            # Complete frames already buffered?
            while len(self._raw) >= 8:
                kind, size = self._raw[0], struct.unpack(">I", self._raw[4:8])[0]
                if len(self._raw) < 8 + size:
                    break
                if kind == 1:
                    out += self._raw[8 : 8 + size]
                self._raw = self._raw[8 + size :]
            if out:
                break
            ready, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
            if not ready:
                return None
            chunk = self.sock.recv(65536)
            if not chunk:
                return b""
            self._raw += chunk
        return bytes(out)

    def kill(self) -> None:
        with self._lock:
            if self._killed:
                return
            self._killed = True
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            self.container.remove(force=True)
        except Exception:  # already gone (NotFound) or daemon hiccup: nothing else to do here
            pass

    def death_reason(self) -> str:
        """``memory`` only when the daemon says the container was OOM-killed; ``killed`` otherwise
        (killed or removed from outside, daemon unreachable). The attach stream can end before the
        daemon has recorded the exit, so wait (briefly) until it no longer reports it running."""
        deadline = time.monotonic() + STATE_SETTLE_S
        while True:
            try:
                self.container.reload()
            except Exception:  # removed (NotFound) or the daemon is unreachable: not the job's doing
                return "killed"
            state = self.container.attrs.get("State", {})
            if state.get("OOMKilled"):
                return "memory"
            if not state.get("Running") or time.monotonic() >= deadline:
                return "killed"
            time.sleep(0.05)


class DockerRuntime:
    """Spawns container sandboxes over one or more Docker daemons."""

    name = "docker"

    def __init__(self, cfg: SandboxConfig) -> None:
        try:
            import docker
        except ImportError as exc:  # pragma: no cover - docker is a dependency
            raise SandboxUnusable(f"the docker SDK is not installed: {exc}") from exc
        self.cfg = cfg
        self.pool_tag = uuid.uuid4().hex[:12]
        self.clients: list[tuple[str, Any]] = []
        problems = []
        for url in cfg.docker_hosts or [""]:
            try:
                client = docker.DockerClient(base_url=url, timeout=120) if url else docker.from_env(timeout=120)
                client.ping()
                client.images.get(cfg.image)
            except docker.errors.ImageNotFound:
                problems.append(f"{url or 'DOCKER_HOST'}: image {cfg.image!r} missing (run scripts/setup_sandbox.sh)")
                continue
            except Exception as exc:
                problems.append(f"{url or 'DOCKER_HOST'}: {exc}")
                continue
            self.clients.append((url or "env", client))
        if not self.clients:
            raise SandboxError("no usable Docker host: " + "; ".join(problems))
        self.live: dict[str, int] = {url: 0 for url, _ in self.clients}
        self._lock = threading.Lock()
        self._reap_stale()

    def _labels(self) -> dict[str, str]:
        return {LABEL: "1", f"{LABEL}.pool": self.pool_tag, f"{LABEL}.owner": f"{socket.gethostname()}:{os.getpid()}"}

    def _reap_stale(self) -> None:
        """Remove sandboxes left behind by dead processes on this host (crash safety)."""
        me = socket.gethostname()
        for _, client in self.clients:
            try:
                for c in client.containers.list(all=True, filters={"label": LABEL}):
                    owner = c.labels.get(f"{LABEL}.owner", "")
                    host, _, pid = owner.rpartition(":")
                    if host == me and pid.isdigit() and not pid_alive(int(pid)):
                        c.remove(force=True)
            except Exception:
                continue

    def _pick(self) -> list[tuple[str, Any]]:
        with self._lock:
            return sorted(self.clients, key=lambda item: self.live[item[0]])

    def spawn(self) -> RunnerHandle:
        """Create, attach and start one container; wait until its runner is ready."""
        errors = []
        for url, client in self._pick():
            container = None
            try:
                container = client.containers.create(
                    self.cfg.image,
                    command=runner_argv(PYTHON, "--runner", runner_opts(self.cfg)),
                    stdin_open=True,
                    tty=False,
                    log_config={"type": "none"},
                    **container_kwargs(self.cfg, self._labels()),
                )
                sock = container.attach_socket(params={"stdin": 1, "stdout": 1, "stream": 1})
                container.start()
                transport = DockerTransport(container, sock)
                handle = start_runner(transport, f"docker-{container.short_id}", self.cfg.start_timeout_s, host=url)
                with self._lock:
                    self.live[url] += 1
                _wrap_close(handle, self, url)
                return handle
            except Exception as exc:
                errors.append(f"{url}: {exc}")
                if container is not None:
                    try:
                        container.remove(force=True)
                    except Exception:
                        pass
        raise SandboxError("could not start a docker sandbox: " + "; ".join(errors))

    def naive(self, job: dict[str, Any]) -> dict[str, Any]:
        """One job in a fresh ``docker run --rm`` (the no-pool baseline)."""
        import json

        _, client = self._pick()[0]
        out = client.containers.run(
            self.cfg.image,
            command=runner_argv(PYTHON, "--oneshot", runner_opts(self.cfg)) + [json.dumps(job)],
            remove=True,
            stdout=True,
            stderr=False,
            **container_kwargs(self.cfg, self._labels()),
        )
        return json.loads(out.splitlines()[-1])

    def close(self) -> None:
        """Remove every container of this pool (also ones whose handle was lost) and close clients."""
        for _, client in self.clients:
            try:
                for c in client.containers.list(all=True, filters={"label": f"{LABEL}.pool={self.pool_tag}"}):
                    c.remove(force=True)
            except Exception:
                pass
            try:
                client.close()
            except Exception:
                pass


def _wrap_close(handle: RunnerHandle, runtime: DockerRuntime, url: str) -> None:
    """Decrement the host's live count exactly once when the handle is closed."""
    original = handle.close
    done = threading.Event()

    def close() -> None:
        original()
        if not done.is_set():
            done.set()
            with runtime._lock:
                runtime.live[url] -= 1

    handle.close = close  # type: ignore[method-assign]
