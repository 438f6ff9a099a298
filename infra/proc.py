"""Service processes: spawn from a typed spec, wait until ready, explain a death, stop the tree.

Every long-lived process the project starts — trainer ranks (through torchrun), the rollout worker,
sandbox runners, the ``deltaloop serve`` stack, the benchmarks' S3 server — goes through this
module, so the same guarantees hold for all of them:

* **Own process group.** A service leads a new session, so stopping it reaches everything it
  started; :func:`stop_processes` also signals descendants that left the group (torchrun ranks,
  flow runs of a Prefect worker). It sends SIGTERM, waits ``grace`` seconds, then SIGKILL.
* **Lifeline.** The spawned process gets ``DELTALOOP_PARENT_PID`` (:mod:`infra.lifeline`); a
  service that calls :func:`~infra.lifeline.exit_with_parent` exits when the flow disappears, even
  after ``kill -9`` of the flow.
* **Log and death reason.** Output goes to one log file; :meth:`ServiceProcess.dead_reason` names
  the exit code or signal and quotes the end of that log.
* **Readiness.** :func:`wait_until` polls a probe (an HTTP URL, a file, a store key, any callable)
  until it answers, raises :class:`ServiceDied` with the death reason as soon as the process exits,
  and gives up at a deadline.
* **Ports without a race.** A service binds its own socket (:func:`bind_socket`, port 0 or the
  configured one) and *reports* the port it got (a ready file, :func:`report_ready`, or a key in the
  object store). Only servers we do not control (Prefect, MLflow) get a port chosen for them
  (:func:`free_port`), and their caller retries on "address already in use"
  (:func:`port_in_use`).
* **One clear error.** :func:`start_with_retry` starts a service again once when it fails to come
  up, then raises :class:`ServiceStartError`, whose message is a single line (the full reason is in
  its ``detail`` and in the log).

No Prefect and no torch here: this is a leaf of ``infra``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

from infra.atomicio import write_json_atomic
from infra.errors import DeltaloopError
from infra.lifeline import PARENT_ENV, pid_alive

T = TypeVar("T")
LOOPBACK = "127.0.0.1"


class ServiceDied(DeltaloopError):
    """The service process exited or the connection to it broke. A restart may help."""

    retryable = True


class ServiceStartError(ServiceDied):
    """A service failed to come up, also on its second attempt. The message is one line.

    ``detail`` holds the full reason (exit status and log tail). Not retryable: the service was
    already started twice."""

    retryable = False

    def __init__(self, what: str, detail: str, attempts: int = 2) -> None:
        super().__init__(f"{what} could not start ({attempts} attempts): {summarize(detail)}")
        self.what = what
        self.detail = detail


# ------------------------------------------------------------------------------------ the spec
@dataclass(frozen=True)
class ServiceSpec:
    """What to run: the command, its environment, folder and log file.

    ``env`` is added to this process's environment (or replaces it when ``inherit_env`` is false);
    ``lifeline`` adds ``DELTALOOP_PARENT_PID`` so the service can exit with its launcher. ``log``
    None discards the output.
    """

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    log: str | None = None
    inherit_env: bool = True
    lifeline: bool = True

    @classmethod
    def python(cls, name: str, module: str, args: list[str], **kw: object) -> "ServiceSpec":
        """``python -m MODULE ARGS`` with this interpreter (providers swap it for the remote one)."""
        return cls(name=name, argv=[sys.executable, "-m", module, *args], **kw)  # type: ignore[arg-type]

    def full_env(self) -> dict[str, str]:
        """The environment the process gets."""
        env = {**os.environ, **self.env} if self.inherit_env else dict(self.env)
        if self.lifeline:
            env[PARENT_ENV] = str(os.getpid())
        return env


# ------------------------------------------------------------------------------- process tree
def proc_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` from /proc (``Z`` = zombie), None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().decode(errors="replace").rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie counts as dead."""
    if not pid_alive(pid):
        return False
    state = proc_state(pid)
    return state is not None and state != "Z"


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (from /proc), breadth first: children before grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                ppid = int(fh.read().decode(errors="replace").rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _signal(procs: list[subprocess.Popen], pids: list[int], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_gone(procs: list[subprocess.Popen], pids: list[int], timeout: float,
               reap: Callable[[], None] | None) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if reap is not None:
            reap()
        gone = all(p.poll() is not None for p in procs) and not any(alive(pid) for pid in pids)
        if gone or time.monotonic() >= deadline:
            return gone
        time.sleep(0.05)


def stop_processes(procs: list[subprocess.Popen], grace: float = 10.0, tree_root: int | None = None,
                   reap: Callable[[], None] | None = None, tree: bool = True) -> list[int]:
    """Stop each process's group and every descendant: SIGTERM, ``grace`` seconds, then SIGKILL.

    Descendants are listed before the first signal (of each process, or of ``tree_root`` when given,
    e.g. a subreaper's own pid), so children that left the group are stopped as well. ``grace`` 0
    kills at once. ``reap`` is called while waiting (a subreaper reaps adopted orphans there).
    ``tree`` False signals the process groups only (no /proc scan: for processes known to keep their
    children in their group, stopped often). Returns the pids that needed SIGKILL. Idempotent.
    """
    roots = [tree_root] if tree_root is not None else [p.pid for p in procs]
    pids = [pid for root in roots for pid in descendants(root)] if tree else []
    killed: list[int] = []
    if grace > 0:
        _signal(procs, pids, signal.SIGTERM)
        if _wait_gone(procs, pids, grace, reap):
            pids = []
    if pids or any(p.poll() is None for p in procs):
        killed = [p.pid for p in procs if p.poll() is None] + [pid for pid in pids if alive(pid)]
        _signal(procs, pids, signal.SIGKILL)
        _wait_gone(procs, pids, 5.0, reap)
    for p in procs:  # stray members of the groups (a child that outlived its leader)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


# --------------------------------------------------------------------------------- logs, death
def tail(path: str | None, lines: int = 30, max_bytes: int = 16384) -> str:
    """The last ``lines`` lines of the file at ``path`` (at most ``max_bytes`` read); "" if none."""
    if not path:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - max_bytes))
            return "\n".join(fh.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def describe_exit(code: int) -> str:
    """``exit code N`` or ``killed by SIGNAME`` for a ``Popen.returncode``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


_ERROR_LINE = re.compile(r"(Error|Exception|error:|Errno|Traceback|refused|denied|not found)", re.I)


def summarize(reason: str, width: int = 300) -> str:
    """One line for a multi-line death reason: its first line plus the log's last error line."""
    lines = [ln.strip() for ln in reason.strip().splitlines() if ln.strip()]
    if not lines:
        return "no reason given"
    head = lines[0]
    errors = [ln for ln in lines[1:] if _ERROR_LINE.search(ln) and not ln.startswith("Traceback")]
    out = f"{head}: {errors[-1]}" if errors and errors[-1] not in head else head
    return out if len(out) <= width else out[: width - 3] + "..."


# -------------------------------------------------------------------------------- one process
class ServiceProcess:
    """One spawned service on this host (see :func:`spawn`).

    Also a cluster service handle (``host``, ``logs``, ``poll``, ``terminate``, ``describe``), which
    is how the ``local`` provider returns a service it placed here.
    """

    def __init__(self, spec: ServiceSpec, proc: subprocess.Popen, host: str = LOOPBACK) -> None:
        self.spec = spec
        self.proc = proc
        self.host = host
        self.logs = [spec.log] if spec.log else []

    @property
    def pid(self) -> int:
        """Pid of the service (leader of its process group)."""
        return self.proc.pid

    def poll(self) -> int | None:
        """None while running; else the exit status (negative: killed by that signal)."""
        return self.proc.poll()

    def tail(self, lines: int = 30) -> str:
        """End of the log file."""
        return tail(self.spec.log, lines)

    def dead_reason(self) -> str | None:
        """None while running; else how it ended, with the end of its log."""
        code = self.proc.poll()
        if code is None:
            return None
        where = f" (log {self.spec.log})" if self.spec.log else ""
        text = self.tail()
        return f"{self.spec.name} stopped: {describe_exit(code)}{where}" + (f"\n{text}" if text else "")

    def wait_ready(self, probe: Callable[[], T | None], timeout_s: float) -> T:
        """Poll ``probe`` until it returns a value (see :func:`wait_until`)."""
        return wait_until(probe, timeout_s, self.dead_reason, self.spec.name)

    def terminate(self, timeout: float = 10.0) -> list[int]:
        """Stop the service's process tree (SIGTERM, ``timeout`` s, SIGKILL). Idempotent."""
        return stop_processes([self.proc], grace=timeout)

    def describe(self) -> str:
        """Name, pid, state and log, for error messages."""
        code = self.proc.poll()
        state = "running" if code is None else describe_exit(code)
        return f"{self.spec.name} pid {self.proc.pid} on {self.host} [{state}]" + (
            f" log {self.spec.log}" if self.spec.log else "")


def spawn(spec: ServiceSpec, **popen: object) -> ServiceProcess:
    """Start ``spec`` in its own session with its output in ``spec.log``; returns at once.

    ``popen`` passes extra ``subprocess.Popen`` arguments (e.g. ``stdin``)."""
    if spec.log:
        Path(spec.log).parent.mkdir(parents=True, exist_ok=True)
        out: object = open(spec.log, "ab")
    else:
        out = subprocess.DEVNULL
    popen.setdefault("stdin", subprocess.DEVNULL)
    try:
        proc = subprocess.Popen(spec.argv, env=spec.full_env(), cwd=spec.cwd, stdout=out,  # type: ignore[call-overload]
                                stderr=subprocess.STDOUT, start_new_session=True, **popen)
    finally:
        if spec.log:
            out.close()  # type: ignore[attr-defined]
    return ServiceProcess(spec, proc)


# ---------------------------------------------------------------------------------- readiness
def wait_until(probe: Callable[[], T | None], timeout_s: float, dead: Callable[[], str | None] | None = None,
               what: str = "service", interval: float = 0.2) -> T:
    """Call ``probe`` until it returns something other than None/False; return that.

    ``dead()`` (None while the service runs, else why it stopped) is checked before every probe, so
    a service that exits fails at once with :class:`ServiceDied` instead of waiting out the deadline.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        reason = dead() if dead is not None else None
        if reason:
            raise ServiceDied(reason)
        got = probe()
        if got is not None and got is not False:
            return got
        if time.monotonic() >= deadline:
            raise ServiceDied(f"{what} was not ready within {timeout_s:.0f}s")
        time.sleep(interval)


def http_probe(url: str, headers: dict[str, str] | None = None, timeout: float = 2.0) -> Callable[[], bool | None]:
    """A probe that is True once ``GET url`` answers 200 (never through a proxy)."""
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def probe() -> bool | None:
        try:
            with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as resp:
                return True if resp.status == 200 else None
        except OSError:
            return None

    return probe


def file_probe(path: str) -> Callable[[], dict | None]:
    """A probe returning the JSON object in ``path`` once it exists (see :func:`report_ready`)."""

    def probe() -> dict | None:
        try:
            return json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return None

    return probe


def report_ready(path: str, **info: object) -> None:
    """Child side of :func:`file_probe`: write ``info`` (e.g. the bound port) atomically to ``path``."""
    write_json_atomic(path, info)


def start_with_retry(what: str, start: Callable[[], T], cleanup: Callable[[], None], attempts: int = 2) -> T:
    """Run ``start`` (launch and wait until ready); on :class:`ServiceDied` clean up and try again.

    After ``attempts`` failures raise :class:`ServiceStartError` (one line; full reason in
    ``detail``)."""
    detail = ""
    for _ in range(attempts):
        try:
            return start()
        except ServiceDied as exc:
            detail = str(exc)
            cleanup()
    raise ServiceStartError(what, detail, attempts)


# -------------------------------------------------------------------------------------- ports
def bind_socket(host: str = LOOPBACK, port: int = 0, backlog: int = 128) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: any free port); read the port it got with
    ``sock.getsockname()[1]`` and report it. Binding in the service itself leaves no window in which
    another process can take the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def free_port(host: str = LOOPBACK) -> int:
    """A port nobody listens on *right now*. Only for servers that cannot report the port they
    bound; another process may take it before the server binds, so callers retry (:func:`port_in_use`)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(text: str) -> bool:
    """True if a death reason or log says the port was taken (``EADDRINUSE``)."""
    return "address already in use" in text.lower() or "errno 98" in text.lower()
