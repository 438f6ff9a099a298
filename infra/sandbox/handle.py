"""Host-side handle of one warm sandbox: a runner reached over a byte stream.

A runtime (bwrap, docker, unsafe_local) only has to provide a :class:`Transport` — send bytes to
the runner's stdin, read bytes from its stdout, kill the whole sandbox. :class:`RunnerHandle` adds
the line protocol, deadlines and the bookkeeping the pool needs (jobs served, age, host).
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Protocol

from infra.proc import stop_processes
from infra.sandbox.types import SandboxDied


class Transport(Protocol):
    """Byte stream to a runner plus a kill switch."""

    def send(self, data: bytes) -> None:
        """Write all of ``data`` to the runner's stdin (raises ``OSError`` or ``ValueError`` when gone)."""

    def read_some(self, timeout: float) -> bytes | None:
        """Up to a few KiB of the runner's stdout; ``None`` on timeout, ``b""`` at end of stream."""

    def kill(self) -> None:
        """Kill every process of the sandbox and release it (idempotent)."""

    def death_reason(self) -> str:
        """After the runner vanished: ``memory`` if the runtime saw an OOM kill, else ``killed``."""


class RunnerHandle:
    """One sandbox: send a job, wait for its reply line, with a hard deadline."""

    def __init__(self, transport: Transport, sandbox_id: str, host: str = "local") -> None:
        self.transport = transport
        self.id = sandbox_id
        self.host = host
        self.jobs = 0
        self.created = time.monotonic()
        self.info: dict[str, Any] = {}
        self._buf = b""
        self._closed = False
        self._lock = threading.Lock()

    def _read_line(self, deadline: float) -> bytes:
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SandboxDied("runner did not answer in time", "timeout")
            try:
                chunk = self.transport.read_some(remaining)
            except (OSError, ValueError) as exc:  # connection reset, or the handle closed under us
                raise SandboxDied(f"runner connection lost: {exc}") from None
            if chunk is None:
                continue
            if not chunk:
                raise SandboxDied("runner exited")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Block until the runner says it is ready; returns its hello message."""
        line = self._read_line(time.monotonic() + timeout)
        try:
            hello = json.loads(line)
        except ValueError:
            raise SandboxDied(f"bad hello from runner: {line[:200]!r}", "garbled") from None
        if not isinstance(hello, dict) or not hello.get("ready"):
            raise SandboxDied(f"runner not ready: {hello}", "garbled")
        self.info = hello
        return hello

    def call(self, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Run one job; ``timeout`` is the host's backstop (job timeout + grace)."""
        with self._lock:
            if self._closed:
                raise SandboxDied("sandbox closed")
            try:
                self.transport.send(json.dumps(job, separators=(",", ":")).encode() + b"\n")
            except (OSError, ValueError) as exc:  # ValueError: its stream was closed (sandbox killed)
                raise SandboxDied(f"runner unreachable: {exc}") from None
            line = self._read_line(time.monotonic() + timeout)
            self.jobs += 1
        try:
            reply = json.loads(line)
        except ValueError:
            raise SandboxDied(f"bad reply from runner: {line[:200]!r}", "garbled") from None
        if not isinstance(reply, dict):
            raise SandboxDied("bad reply from runner", "garbled")
        return reply

    def idle_ok(self) -> bool:
        """Whether an idle sandbox still looks alive, without blocking. An idle runner sends
        nothing, so anything readable — end of stream (killed while idle) or stray bytes — means
        this sandbox must not be handed a job."""
        if self._closed or self._buf:
            return False
        try:
            return self.transport.read_some(0.0) is None
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        """Kill the sandbox (idempotent)."""
        self._closed = True
        self.transport.kill()


def start_runner(transport: Transport, sandbox_id: str, timeout: float, host: str = "local") -> RunnerHandle:
    """Wrap a freshly spawned runner in a handle and wait for its ready line; on any failure the
    sandbox is killed before the error propagates (no half-started sandbox is left behind)."""
    handle = RunnerHandle(transport, sandbox_id, host=host)
    try:
        handle.wait_ready(timeout)
    except BaseException:
        handle.close()
        raise
    return handle


class _Spawner:
    """One long-lived thread that forks every sandbox process.

    ``bwrap --die-with-parent`` uses PR_SET_PDEATHSIG, which fires when the parent *thread* exits:
    a sandbox forked from a short-lived warmer thread would be killed with it. Forking from a thread
    that lives as long as the process keeps the guarantee (sandbox dies with the pool's process)
    without that trap.
    """

    _lock = threading.Lock()
    _queue: "queue.Queue[tuple[Callable[[], Any], Future[Any]]] | None" = None

    @classmethod
    def run(cls, fn: Callable[[], Any]) -> Any:
        with cls._lock:
            if cls._queue is None:
                cls._queue = queue.Queue()
                threading.Thread(target=cls._loop, args=(cls._queue,), name="sandbox-spawner", daemon=True).start()
        fut: Future[Any] = Future()
        cls._queue.put((fn, fut))
        return fut.result()

    @staticmethod
    def _loop(q: "queue.Queue[tuple[Callable[[], Any], Future[Any]]]") -> None:
        while True:
            fn, fut = q.get()
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the caller
                fut.set_exception(exc)


class PipeTransport:
    """A runner started as a local subprocess (bwrap or unsafe_local), in its own session."""

    def __init__(self, argv: list[str], env: dict[str, str], user: int | None = None) -> None:
        kwargs: dict[str, Any] = {}
        if user is not None:
            kwargs.update(user=user, group=user, extra_groups=[])
        debug = os.environ.get("DELTALOOP_SANDBOX_DEBUG")
        self.proc: subprocess.Popen[bytes] = _Spawner.run(
            lambda: subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=None if debug else subprocess.DEVNULL,
                env=env,
                close_fds=True,
                start_new_session=True,
                cwd="/",
                **kwargs,
            )
        )
        self._fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        self._killed = False
        self._kill_lock = threading.Lock()

    def send(self, data: bytes) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        stdin.write(data)
        stdin.flush()

    def read_some(self, timeout: float) -> bytes | None:
        ready, _, _ = select.select([self._fd], [], [], max(0.0, timeout))
        if not ready:
            return None
        return os.read(self._fd, 65536)

    def kill(self) -> None:
        with self._kill_lock:
            if self._killed:
                return
            self._killed = True
        stop_processes([self.proc], grace=0, tree=False)  # the runner's group: everything it started
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass

    def death_reason(self) -> str:
        return "killed"  # no cgroup: nothing on the host records an OOM kill of the runner
