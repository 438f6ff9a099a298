"""``cluster.type: hosts`` — trainer ranks on machines reached over SSH, joined by torchrun rendezvous.

Each used host runs, through one ``ssh`` child process of this (the flow's) process::

    ssh HOST  cd WORKDIR && exec PYTHON -m infra.cluster.hosts agent

The *agent* (bottom of this module) reads a one-line JSON spec (command, environment) from stdin,
so no secret appears on a command line, and starts ``torch.distributed.run`` in its own session with
the given env. It is a child *subreaper*: every process torchrun spawns (rank workers run in new
sessions) stays its descendant, so it can always find and kill the whole tree. The agent stops the
tree when

* its stdin reaches EOF — the ssh connection or the flow process went away (a dead-man switch: no
  rank outlives the process that launched it, even after ``kill -9`` of the flow), or
* it receives SIGTERM/SIGHUP (``GroupHandle.terminate`` sends one through a second ssh call if the
  first connection hangs; the agent's pid is in a pid file on the host).

Its exit status is torchrun's, and ssh hands it back, so ``poll()`` sees each node's result; all
output is streamed back over ssh into ``log_dir/node<i>-<host>.log`` (no shared filesystem needed).

Rendezvous: ``c10d`` (default) runs torchrun's dynamic rendezvous with its store on the first host
(``is_host`` is set explicitly, so hostname heuristics never matter). torch orders nodes by their
address, so global rank 0 lands on the host whose ``addr`` sorts first as a string; that host is
``handle.master_addr``. ``static`` gives node rank i to the i-th host and rank 0 to the first host.

A single service (the rollout worker, :meth:`HostsProvider.launch_service`) runs the same way through
an agent on the first used host; ``handle.host`` is that host's address. The service binds its own
port there and reports it (through the object store), so the flow reaches it across hosts.

Hosts are taken in order until their slots equal ``cluster.ranks``; the remaining hosts are spares.
:meth:`HostsProvider.replace` swaps a failing host for a spare (used after a failed health check).

Assumptions: the same repo folder (``cluster.workdir``) and Python (``cluster.remote_python``) on
every host, key-based ssh (``BatchMode``), hosts able to reach each other at their ``addr``.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from infra.cluster.base import ClusterError, group_exit_code
from infra.config import ClusterConfig, HostSpec, select_hosts
from infra.proc import (ServiceDied, ServiceSpec, descendants, free_port, port_in_use, spawn, stop_processes,
                        wait_until)

REPO_ROOT = str(Path(__file__).resolve().parents[2])


class HostfileError(ClusterError):
    """The hostfile is missing or malformed; retrying cannot help."""

    retryable = False


# ------------------------------------------------------------------------------------ hostfile
def parse_hostfile(path: str) -> list[HostSpec]:
    """Read ``HOST [slots=N] [port=P] [user=U] [addr=A]`` lines (``#`` comments, blank lines ok)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise HostfileError(f"cannot read hostfile {path}: {exc}") from None
    keys = {"slots": "slots", "port": "ssh_port", "ssh_port": "ssh_port", "user": "user", "addr": "addr"}
    hosts: list[HostSpec] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, *opts = line.split()
        fields: dict[str, object] = {"host": host}
        for opt in opts:
            name, sep, value = opt.partition("=")
            if not sep or name not in keys:
                raise HostfileError(f"{path}:{lineno}: bad option {opt!r}; use slots=N port=P user=U addr=A")
            fields[keys[name]] = value
        try:
            hosts.append(HostSpec.model_validate(fields))
        except ValueError as exc:
            raise HostfileError(f"{path}:{lineno}: {exc}") from None
    if not hosts:
        raise HostfileError(f"hostfile {path} lists no hosts")
    return hosts


# ------------------------------------------------------------------------------------ launching
def ssh_argv(cfg: ClusterConfig, host: HostSpec, remote_cmd: str) -> list[str]:
    """The ``ssh`` command line that runs ``remote_cmd`` (a shell string) on ``host``."""
    argv = [
        "ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={cfg.ssh_connect_timeout_s}",
        "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3", "-p", str(host.ssh_port),
    ]
    if cfg.ssh_key:
        argv += ["-i", cfg.ssh_key, "-o", "IdentitiesOnly=yes"]
    if host.user:
        argv += ["-l", host.user]
    if host.proxy_command:
        argv += ["-o", f"ProxyCommand={host.proxy_command}"]
    return [*argv, *cfg.ssh_options, host.host, "--", remote_cmd]


def torchrun_argv(
    cfg: ClusterConfig, hosts: list[HostSpec], index: int, run_id: str, module: str, args: list[str]
) -> list[str]:
    """torchrun command for node ``index`` of ``hosts``."""
    python = cfg.remote_python or sys.executable
    head = hosts[0].node_addr
    argv = [python, "-m", "torch.distributed.run", f"--nnodes={len(hosts)}",
            f"--nproc_per_node={hosts[index].slots}", "--max_restarts=0"]
    if cfg.rendezvous == "c10d":
        argv += [
            "--rdzv_backend=c10d", f"--rdzv_endpoint={head}:{cfg.rdzv_port}", f"--rdzv_id={run_id}",
            f"--local_addr={hosts[index].node_addr}",
            f"--rdzv_conf=is_host={int(index == 0)},join_timeout={int(cfg.start_timeout_s)}",
        ]
    else:
        argv += [f"--node_rank={index}", f"--master_addr={head}", f"--master_port={cfg.rdzv_port}"]
    return [*argv, "-m", module, *args]


def rank0_addr(cfg: ClusterConfig, hosts: list[HostSpec]) -> str:
    """Where global rank 0 runs (see the module docstring for the c10d ordering)."""
    if cfg.rendezvous == "c10d":
        return min(h.node_addr for h in hosts)
    return hosts[0].node_addr


@dataclass
class _Node:
    host: HostSpec
    proc: subprocess.Popen
    log: str
    pidfile: str


@dataclass
class HostsGroup:
    """One ssh child per host; see the module docstring for how ranks are stopped."""

    cfg: ClusterConfig
    nodes: list[_Node]
    master_addr: str
    logs: list[str] = field(default_factory=list)
    tunnels: list[subprocess.Popen] = field(default_factory=list)

    @property
    def host(self) -> str:
        """Address of the rank-0 host (for a single service: the host it runs on)."""
        return self.master_addr

    def poll(self) -> int | None:
        return group_exit_code([n.proc.poll() for n in self.nodes])

    def tunnel(self, addr: str, port: int, timeout: float = 15.0) -> tuple[str, int]:
        """Forward a local loopback port to ``addr:port`` as seen from the rank-0 host (``ssh -L``).

        For a flow that cannot reach the hosts' network directly (bastions, namespaces): connect to
        the returned ``(host, port)`` instead. The tunnel closes with :meth:`terminate`.
        """
        import socket

        node = next((n for n in self.nodes if n.host.node_addr == self.master_addr), self.nodes[0])
        err = ""
        for _ in range(2):  # ssh -L cannot report a port it chose: pick one, retry if it was taken
            local = free_port()
            argv = ssh_argv(self.cfg, node.host, "")[:-2]  # no remote command
            argv[1:1] = ["-N", "-o", "ExitOnForwardFailure=yes", "-L", f"127.0.0.1:{local}:{addr}:{port}"]
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, start_new_session=True)
            self.tunnels.append(proc)

            def probe() -> bool:
                try:
                    socket.create_connection(("127.0.0.1", local), timeout=1).close()
                    return True
                except OSError:
                    return False

            dead = lambda: None if proc.poll() is None else "ssh exited"  # noqa: E731
            try:
                wait_until(probe, timeout, dead, "ssh tunnel", interval=0.1)
                return "127.0.0.1", local
            except ServiceDied:
                err = proc.stderr.read().decode(errors="replace") if proc.poll() is not None and proc.stderr else ""
                proc.kill()
                if not port_in_use(err):
                    break
        raise ClusterError(f"cannot open ssh tunnel to {addr}:{port} via {node.host.host}: {err.strip()}")

    def failed_hosts(self) -> list[str]:
        """Hosts whose node exited with a non-zero code (ssh 255: connection failed)."""
        return [n.host.host for n in self.nodes if n.proc.poll() not in (None, 0)]

    def terminate(self, timeout: float = 10.0) -> None:
        for t in self.tunnels:
            if t.poll() is None:
                t.kill()
                t.wait()
        for n in self.nodes:  # EOF on the agent's stdin: it stops its tree (TERM, then KILL)
            if n.proc.stdin and not n.proc.stdin.closed:
                try:
                    n.proc.stdin.close()
                except OSError:
                    pass
        if self._wait(timeout):
            return
        for n in self.nodes:  # connection hung: signal the agent through a fresh ssh
            if n.proc.poll() is None:
                kill = f"kill -TERM $(cat {shlex.quote(n.pidfile)}) 2>/dev/null"
                try:
                    subprocess.run(ssh_argv(self.cfg, n.host, kill), stdin=subprocess.DEVNULL,
                                   capture_output=True, timeout=self.cfg.ssh_connect_timeout_s + 5)
                except subprocess.TimeoutExpired:
                    pass
        self._wait(timeout)
        for n in self.nodes:
            if n.proc.poll() is None:
                n.proc.kill()
                n.proc.wait()

    def _wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(n.proc.poll() is not None for n in self.nodes):
                return True
            time.sleep(0.05)
        return all(n.proc.poll() is not None for n in self.nodes)

    def describe(self) -> str:
        parts = []
        for i, n in enumerate(self.nodes):
            code = n.proc.poll()
            state = "running" if code is None else f"exit {code}" + (" (ssh failed)" if code == 255 else "")
            parts.append(f"node{i} {n.host.host} [{state}] log {n.log}")
        return f"rank 0 on {self.master_addr}; " + "; ".join(parts)


class HostsProvider:
    """Launches torchrun on every used host over ssh (see the module docstring)."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        all_hosts = parse_hostfile(cfg.hostfile) if cfg.hostfile else list(cfg.hosts)
        try:
            self.hosts, self.spares = select_hosts(all_hosts, cfg.ranks)
        except ValueError as exc:
            raise HostfileError(str(exc)) from None
        self.world_size = cfg.ranks

    def replace(self, bad: list[str]) -> list[tuple[str, str]]:
        """Swap each used host named in ``bad`` (host or addr) for a spare with the same slots.

        Returns the (old, new) pairs; raises :class:`ClusterError` when a host cannot be replaced.
        """
        swaps: list[tuple[str, str]] = []
        for i, h in enumerate(self.hosts):
            if h.host not in bad and h.node_addr not in bad:
                continue
            spare = next((s for s in self.spares if s.slots == h.slots), None)
            if spare is None:
                raise ClusterError(f"host {h.host} is unhealthy and no spare host with {h.slots} slot(s) is left")
            self.spares.remove(spare)
            self.hosts[i] = spare
            swaps.append((h.host, spare.host))
        return swaps

    def _env(self, env: dict[str, str]) -> dict[str, str]:
        """``forward_env`` from this process plus ``env``."""
        base_env = {name: os.environ[name] for name in self.cfg.forward_env if name in os.environ}
        base_env.update(env)
        base_env.setdefault("OMP_NUM_THREADS", str(self.cfg.threads_per_rank))
        return base_env

    def _start_node(self, host: HostSpec, cmd: list[str], env: dict[str, str], log: str, pidfile: str) -> _Node:
        """Start the agent on ``host`` over ssh and hand it ``cmd`` and ``env`` on its stdin."""
        workdir = self.cfg.workdir or REPO_ROOT
        python = self.cfg.remote_python or sys.executable
        remote = f"cd {shlex.quote(workdir)} && exec {shlex.quote(python)} -m infra.cluster.hosts agent"
        ssh = ServiceSpec(name=f"agent on {host.host}", argv=ssh_argv(self.cfg, host, remote), log=log, lifeline=False)
        proc = spawn(ssh, stdin=subprocess.PIPE).proc
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"cmd": cmd, "env": env, "pidfile": pidfile}).encode() + b"\n")
        proc.stdin.flush()
        return _Node(host, proc, log, pidfile)

    def launch(self, module: str, args: list[str], env: dict[str, str], log_dir: str) -> HostsGroup:
        """Start torchrun on every used host; each node's output streams into ``log_dir``."""
        run_id = f"deltaloop-{uuid.uuid4().hex[:12]}"
        base_env = self._env(env)
        nodes: list[_Node] = []
        try:
            for i, host in enumerate(self.hosts):
                nodes.append(self._start_node(
                    host, torchrun_argv(self.cfg, self.hosts, i, run_id, module, args),
                    {**base_env, "DELTALOOP_NODE_INDEX": str(i), "DELTALOOP_NODE_HOST": host.host},
                    str(Path(log_dir) / f"node{i}-{host.host}.log"), f"/tmp/{run_id}-node{i}.pid"))
        except BaseException:
            HostsGroup(self.cfg, nodes, "").terminate(timeout=2)
            raise
        return HostsGroup(self.cfg, nodes, rank0_addr(self.cfg, self.hosts), logs=[n.log for n in nodes])

    def launch_service(self, spec: ServiceSpec) -> HostsGroup:
        """Run ``spec`` on the first used host through an agent; ``handle.host`` is that host's address.

        ``spec.argv[0]`` when it is this interpreter becomes ``cluster.remote_python``; ``spec.cwd``
        is ignored (the agent runs in ``cluster.workdir``); the output streams into ``spec.log``."""
        host = self.hosts[0]
        python = self.cfg.remote_python or sys.executable
        argv = [python if spec.argv[0] == sys.executable else spec.argv[0], *spec.argv[1:]]
        env = self._env(spec.env)
        if spec.lifeline:  # the agent replaces it with its own pid: the service dies with the agent
            env["DELTALOOP_PARENT_PID"] = str(os.getpid())
        log = spec.log or os.devnull
        node = self._start_node(host, argv, env, log, f"/tmp/deltaloop-{spec.name}-{uuid.uuid4().hex[:12]}.pid")
        return HostsGroup(self.cfg, [node], host.node_addr, logs=[log] if spec.log else [])


# ------------------------------------------------------------------------------ remote agent
def _reap(proc: subprocess.Popen) -> None:
    """Reap exited children (orphans we adopted), letting ``proc`` keep its own exit code."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None:
            return
        if info.si_pid == proc.pid:
            proc.poll()
            if proc.returncode is None:
                return
            continue
        try:
            os.waitpid(info.si_pid, 0)
        except ChildProcessError:
            pass


def agent_main(grace_s: float = 10.0) -> int:
    """Run on each host: start the spec's command, stop its whole tree on stdin EOF or a signal."""
    import ctypes

    line = b""
    while not line.endswith(b"\n"):  # unbuffered: the rest of stdin is only watched for EOF
        chunk = os.read(0, 1)
        if not chunk:
            return 2
        line += chunk
    spec = json.loads(line)
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans stay ours
    env = {**os.environ, **spec["env"]}
    if "DELTALOOP_PARENT_PID" in env:  # ranks watching their launcher watch this agent instead
        env["DELTALOOP_PARENT_PID"] = str(os.getpid())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    libc = ctypes.CDLL(None, use_errno=True)

    def die_with_agent() -> None:  # if the agent itself is killed, torchrun gets SIGTERM
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG

    proc = subprocess.Popen(spec["cmd"], env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=die_with_agent)
    Path(spec["pidfile"]).write_text(str(os.getpid()))

    def watch_stdin() -> None:
        while os.read(0, 4096):
            pass
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    while proc.poll() is None and not stop.wait(0.2):
        pass
    if proc.poll() is None:
        try:  # the ssh channel may be gone already: writing must not kill the agent
            print(f"[deltaloop agent] stopping rank tree on {os.uname().nodename}", file=sys.stderr, flush=True)
        except OSError:
            pass
    if descendants(os.getpid()):
        stop_processes([proc], grace=grace_s, tree_root=os.getpid(), reap=lambda: _reap(proc))
    code = proc.wait()
    _reap(proc)
    try:
        os.unlink(spec["pidfile"])
    except OSError:
        pass
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    if sys.argv[1:] == ["agent"]:
        rc = agent_main()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:
                pass
        os._exit(rc)  # not sys.exit: the stdin watcher thread may still be blocked in read()
    sys.exit("usage: python -m infra.cluster.hosts agent   (run by the hosts provider over ssh)")
