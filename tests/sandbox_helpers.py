"""Test helpers for real sandbox pools: the runtimes to run over, one set of pool settings, opening a
pool (a missing runtime is a skip locally and a failure on CI), and the check that ``close()`` left no
sandbox process or container behind.

The integration tests that execute untrusted programs (hostile jobs, trusted unit tests, datasets,
HumanEval, multi-turn tools) share these so that they agree on what "unavailable" means and on how
strictly teardown is checked.

Fault injection from outside (issue #16): :func:`own_sandboxes` finds the sandboxes this test process
started by looking at the host as an operator would (``/proc`` for bwrap, the daemon for docker),
never at the pool's internals, and :func:`kill_sandbox` kills one for real (``kill -9`` of the bwrap
process group, ``docker kill`` of the container).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple, NoReturn

import pytest

from infra.config import SandboxConfig
from infra.sandbox import SandboxError, SandboxPool, create_pool

__all__ = ["RUNTIMES", "SANDBOX_UID", "Sandbox", "assert_no_sandbox_left", "kill_sandbox", "open_pool",
           "own_sandboxes", "running_pool", "sandbox_config", "unavailable"]

RUNTIMES = ["bwrap", pytest.param("docker", marks=pytest.mark.docker)]
SANDBOX_UID = 65534  # SandboxConfig.uid's default: every sandbox process runs as this uid on the host
_LABEL = "org.deltaloop.sandbox"


def unavailable(why: str) -> NoReturn:
    """Skip the test because a sandbox runtime is missing; on CI (``CI=true``) fail instead, since CI
    installs both runtimes (scripts/setup_sandbox.sh) and a skip there would hide a broken setup."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"sandbox runtime unavailable on CI: {why}")
    pytest.skip(why)


def sandbox_config(runtime: str, **kw: object) -> SandboxConfig:
    """The tests' pool settings for ``runtime``, with ``kw`` overriding any of them.

    The job timeout is generous (20 s) so that programs which should finish are never cut short by a
    loaded 2-core CI machine; tests of hanging programs pass their own short timeouts.
    """
    base: dict[str, object] = dict(runtime=runtime, concurrency=2, min_warm=2, max_warm=4, timeout_s=20.0,
                                   memory_mb=256, pids=32, output_limit_bytes=65536, idle_timeout_s=60)
    base.update(kw)
    return SandboxConfig(**base)  # type: ignore[arg-type]


def open_pool(runtime: str, **kw: object) -> SandboxPool:
    """A started pool over ``runtime`` with :func:`sandbox_config` settings (``kw`` overrides them);
    calls :func:`unavailable` when bubblewrap is not installed or the runtime cannot start sandboxes."""
    if runtime == "bwrap" and shutil.which("bwrap") is None:
        unavailable("bubblewrap is not installed (run scripts/setup_sandbox.sh)")
    try:
        return create_pool(sandbox_config(runtime, **kw)).start()
    except SandboxError as exc:
        unavailable(f"{runtime}: {exc}")


@contextmanager
def running_pool(runtime: str, **kw: object) -> Iterator[SandboxPool]:
    """:func:`open_pool`, yielded; on leaving, the pool is closed and, unless the body raised,
    :func:`assert_no_sandbox_left` checks that closing it removed every sandbox."""
    pool = open_pool(runtime, **kw)
    try:
        yield pool
    finally:
        pool.close()
    assert_no_sandbox_left(runtime)


def assert_no_sandbox_left(runtime: str, deadline_s: float = 30.0) -> None:
    """After ``close()``: within ``deadline_s``, no process of the sandbox uid remains on this host
    and, for docker, no container labelled ``org.deltaloop.sandbox`` owned by this process remains.

    The uid check sees every sandbox on the machine, including other test processes' pools; a
    failure while another session runs sandboxes can be theirs.
    """
    end = time.monotonic() + deadline_s
    while True:
        left: list[object] = list(_pids_of_uid(SANDBOX_UID))
        if runtime == "docker":
            left += _own_containers()
        if not left or time.monotonic() > end:
            break
        time.sleep(0.1)
    assert not left, f"sandbox processes/containers survived close(): {left}"


def _pids_of_uid(uid: int) -> list[int]:
    """Pids of the host processes owned by ``uid`` (ones that exit while being read are passed over)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    out.append(int(name))
            except OSError:
                continue
    return out


def _own_containers() -> list[str]:
    """Ids of the sandbox containers (running or not) whose owner label names this process."""
    import docker

    client = docker.from_env()
    try:
        return [c["Id"] for c in client.api.containers(all=True, filters={"label": _LABEL})
                if (c.get("Labels") or {}).get(f"{_LABEL}.owner", "").endswith(f":{os.getpid()}")]
    finally:
        client.close()


# ------------------------------------------------------------------------------ fault injection
class Sandbox(NamedTuple):
    """One sandbox of this test process, as seen from the host."""

    runtime: str
    target: str  #: the bwrap process's pid (leader of its process group) or the container id
    busy: bool  #: a job runs in it now


def _proc_tree() -> dict[int, list[int]]:
    """Host process tree: pid -> child pids (processes that exit while being read are passed over)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    return children


def _depth(tree: dict[int, list[int]], pid: int) -> int:
    """How many generations of descendants ``pid`` has (0: none)."""
    kids = tree.get(pid, [])
    return 1 + max(_depth(tree, k) for k in kids) if kids else 0


def own_sandboxes(runtime: str) -> list[Sandbox]:
    """The sandboxes this test process started, seen from the host.

    bwrap: children of this process named ``bwrap``; a job runs when the tree below it is bwrap ->
    runner -> zygote -> worker (3 generations). docker: containers whose owner label names this
    process; a job runs when the container's init (the runner) has a grandchild (zygote -> worker).
    """
    tree = _proc_tree()
    if runtime == "bwrap":
        out = []
        for pid in tree.get(os.getpid(), []):
            try:
                with open(f"/proc/{pid}/comm") as fh:
                    if fh.read().strip() != "bwrap":
                        continue
            except OSError:
                continue
            out.append(Sandbox("bwrap", str(pid), _depth(tree, pid) >= 3))
        return out
    import docker

    client = docker.from_env()
    try:
        out = []
        for c in client.api.containers(filters={"label": _LABEL}):  # running ones, no per-container lookup
            if not (c.get("Labels") or {}).get(f"{_LABEL}.owner", "").endswith(f":{os.getpid()}"):
                continue
            try:
                init = int(client.api.inspect_container(c["Id"])["State"]["Pid"])
            except docker.errors.NotFound:  # removed meanwhile
                continue
            out.append(Sandbox("docker", c["Id"], init > 0 and _depth(tree, init) >= 2))
        return out
    finally:
        client.close()


def kill_sandbox(sandbox: Sandbox) -> None:
    """Kill one sandbox from outside, for real: SIGKILL to the bwrap process group (only a group this
    process started: its leader is our child), or ``docker kill`` of the container."""
    if sandbox.runtime == "bwrap":
        pid = int(sandbox.target)
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return
    subprocess.run(["docker", "kill", sandbox.target], capture_output=True, timeout=60, check=False)
