"""Test helpers for real sandbox pools: the runtimes to run over, one set of pool settings, opening a
pool (a missing runtime is a skip locally and a failure on CI), and the check that ``close()`` left no
sandbox process or container behind.

The integration tests that execute untrusted programs (hostile jobs, trusted unit tests, datasets,
HumanEval, multi-turn tools) share these so that they agree on what "unavailable" means and on how
strictly teardown is checked.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import pytest

from infra.config import SandboxConfig
from infra.sandbox import SandboxError, SandboxPool, create_pool

__all__ = ["RUNTIMES", "SANDBOX_UID", "assert_no_sandbox_left", "open_pool", "running_pool", "sandbox_config",
           "unavailable"]

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
        return [c.id for c in client.containers.list(all=True, filters={"label": _LABEL})
                if c.labels.get(f"{_LABEL}.owner", "").endswith(f":{os.getpid()}")]
    finally:
        client.close()
