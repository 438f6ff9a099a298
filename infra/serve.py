"""``deltaloop serve``: the operations stack on one host — Prefect server, worker, MLflow server.

Starts, on loopback by default, each as a child process in its own process group:

1. ``prefect server start`` (API + UI; its database under ``PREFECT_HOME`` or ``--prefect-db``);
2. ``mlflow server`` with the model registry. By default it serves the *same* sqlite store and
   artifact folder that runs write under ``run_root`` (``<run_root>/mlflow.db``,
   ``<run_root>/mlartifacts``), so flows need no tracking server to be up and the UI shows every
   run; ``--mlflow-backend`` / ``--mlflow-artifacts`` take a Postgres URI / an ``s3://`` root
   instead (then configs set ``tracking.uri`` to the server's URL);
3. the ``deltaloop-process`` work pool, ``prefect deploy --all`` of ``prefect.yaml``, and a worker.

It then prints the URLs and waits. Ctrl-C (SIGINT) or SIGTERM stops every child — worker first,
so running flow runs are cancelled while the servers are still up — by process group, then kills
any descendant that escaped its group. Prefect is driven only through its CLI (no import here).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from infra.errors import DeltaloopError
from infra.lifeline import pid_alive

POOL = "deltaloop-process"
MLFLOW_UI_ENV = "DELTALOOP_MLFLOW_UI_URL"


class ServeError(DeltaloopError):
    """A part of the stack failed to start; the message names it and quotes its log."""


@dataclass
class ServeOptions:
    """What to start and where. Paths are resolved against the current directory."""

    host: str = "127.0.0.1"
    prefect_port: int = 4200  # 0 = any free port
    mlflow_port: int = 5000
    project_dir: Path = field(default_factory=Path.cwd)  # holds prefect.yaml; flows run here
    run_root: Path = Path("runs")
    state_dir: Path | None = None  # logs + serve.json; default $DELTALOOP_STATE/serve
    prefect_db: str | None = None  # PREFECT_SERVER_DATABASE_CONNECTION_URL (e.g. postgresql+asyncpg://...)
    mlflow_backend: str | None = None  # default sqlite:///<run_root>/mlflow.db
    mlflow_artifacts: str | None = None  # default <run_root>/mlartifacts
    pool: str = POOL
    deploy: bool = True
    worker: bool = True
    worker_limit: int = 1  # concurrent flow runs; each run starts its own trainer/rollout/sandboxes
    api_auth_string: str | None = None  # "user:password" basic auth on the Prefect API
    extra_env: dict[str, str] = field(default_factory=dict)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port(host: str, port: int, what: str) -> int:
    if port == 0:
        return free_port(host)
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            raise ServeError(f"{what} port {host}:{port} is in use (choose another, or 0 for any free port)") from None
    return port


def _bin(name: str) -> str:
    """The console script next to this interpreter (the venv's), else on PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _alive(pid: int) -> bool:
    if not pid_alive(pid):
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Stack:
    """The running processes of ``deltaloop serve``; a context manager that always stops them."""

    def __init__(self, opts: ServeOptions, say: Callable[[str], None] = print) -> None:
        self.opts = opts
        self.say = say
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}
        state = opts.state_dir or Path(os.environ.get("DELTALOOP_STATE", ".state")) / "serve"
        self.state_dir = Path(state).resolve()
        self.log_dir = self.state_dir / "logs"
        self.project_dir = Path(opts.project_dir).resolve()
        self.run_root = (self.project_dir / opts.run_root).resolve()
        self.env: dict[str, str] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------ start
    def start(self) -> dict[str, str]:
        """Start everything, deploy, return the URLs. On failure, stops what started and raises."""
        o = self.opts
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.run_root.mkdir(parents=True, exist_ok=True)
        pport = _port(o.host, o.prefect_port, "Prefect")
        mport = _port(o.host, o.mlflow_port, "MLflow")
        api = f"http://{o.host}:{pport}/api"
        self.urls = {"prefect_ui": f"http://{o.host}:{pport}", "prefect_api": api,
                     "mlflow_ui": f"http://{o.host}:{mport}"}
        self.env = {**os.environ, **o.extra_env, "PREFECT_API_URL": api, MLFLOW_UI_ENV: self.urls["mlflow_ui"],
                    "PREFECT_UI_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "NO_PROXY": ",".join(filter(None, [os.environ.get("NO_PROXY"), o.host, "localhost"]))}
        # MLflow's background job runner (GenAI jobs; three huey consumers) is not used here
        self.env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
        if o.api_auth_string:
            self.env["PREFECT_SERVER_API_AUTH_STRING"] = o.api_auth_string
            self.env["PREFECT_API_AUTH_STRING"] = o.api_auth_string
        if o.prefect_db:
            self.env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = o.prefect_db
        try:
            self._spawn("prefect-server", [_bin("prefect"), "server", "start", "--host", o.host, "--port", str(pport)])
            backend = o.mlflow_backend or f"sqlite:///{self.run_root / 'mlflow.db'}"
            artifacts = o.mlflow_artifacts or str(self.run_root / "mlartifacts")
            self._spawn("mlflow-server", [_bin("mlflow"), "server", "--host", o.host, "--port", str(mport),
                                          "--backend-store-uri", backend, "--default-artifact-root", artifacts,
                                          "--artifacts-destination", artifacts, "--workers", "1"])
            self._wait_http("prefect-server", f"{api}/health", 180)
            self._wait_http("mlflow-server", f"{self.urls['mlflow_ui']}/health", 180)
            self._cli("work pool", [_bin("prefect"), "work-pool", "create", o.pool, "--type", "process", "--overwrite"])
            if o.deploy:
                self._cli("deploy", [_bin("prefect"), "--no-prompt", "deploy", "--all"], timeout=300)
            if o.worker:
                self._spawn("worker", [_bin("prefect"), "worker", "start", "--pool", o.pool, "--type", "process",
                                       "--limit", str(o.worker_limit)])
            self._write_state()
        except BaseException:
            self.stop()
            raise
        return self.urls

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.log_dir / f"{name}.log", "ab")
        proc = subprocess.Popen(cmd, cwd=self.project_dir, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        with self._lock:
            self.procs[name] = proc

    def _tail(self, name: str, n: int = 30) -> str:
        p = self.log_dir / f"{name}.log"
        lines = p.read_text(errors="replace").splitlines()[-n:] if p.exists() else []
        return "\n".join(lines)

    def _wait_http(self, name: str, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        req = urllib.request.Request(url, headers=self._auth_header())
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
        while time.monotonic() < deadline:
            proc = self.procs[name]
            if proc.poll() is not None:
                raise ServeError(f"{name} exited with code {proc.returncode}:\n{self._tail(name)}")
            try:
                with opener.open(req, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise ServeError(f"{name} did not answer {url} within {timeout:.0f}s:\n{self._tail(name)}")

    def _auth_header(self) -> dict[str, str]:
        import base64

        s = self.opts.api_auth_string
        return {"Authorization": "Basic " + base64.b64encode(s.encode()).decode()} if s else {}

    def _cli(self, what: str, cmd: list[str], timeout: float = 120) -> None:
        out = subprocess.run(cmd, cwd=self.project_dir, env=self.env, capture_output=True, text=True,
                             timeout=timeout, stdin=subprocess.DEVNULL)
        (self.log_dir / f"{what.replace(' ', '-')}.log").write_text(out.stdout + out.stderr)
        if out.returncode != 0:
            raise ServeError(f"{what} failed ({' '.join(cmd[1:])}):\n{(out.stdout + out.stderr)[-3000:]}")

    def _write_state(self) -> None:
        pids = {k: p.pid for k, p in self.procs.items()}
        state = {"urls": self.urls, "pids": pids, "pool": self.opts.pool, "run_root": str(self.run_root),
                 "project_dir": str(self.project_dir), "logs": str(self.log_dir)}
        (self.state_dir / "serve.json").write_text(json.dumps(state, indent=2))

    # ------------------------------------------------------------------------------ run / stop
    def dead(self) -> str | None:
        """Name and exit code of a child that stopped on its own, if any."""
        for name, p in list(self.procs.items()):
            if p.poll() is not None:
                return f"{name} exited with code {p.returncode}"
        return None

    def wait(self, stop: threading.Event, poll: float = 1.0) -> str:
        """Block until ``stop`` is set or a child dies; returns why."""
        while not stop.wait(poll):
            why = self.dead()
            if why:
                return why + ":\n" + self._tail(why.split()[0])
        return "stop requested"

    def stop(self, grace: float = 20.0) -> list[int]:
        """Stop every child (reverse start order) and their descendants. Returns pids that needed SIGKILL."""
        killed: list[int] = []
        with self._lock:
            items = list(self.procs.items())[::-1]
        for name, proc in items:
            tree = descendants(proc.pid)
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if sig == signal.SIGKILL:
                    killed += [p for p in [proc.pid, *tree] if _alive(p)]
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
                for pid in tree:  # descendants that left the group (flow runs, their services)
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5)
                while time.monotonic() < deadline and any(_alive(p) for p in [proc.pid, *tree]):
                    try:
                        proc.wait(timeout=0.2)
                    except subprocess.TimeoutExpired:
                        pass
                if not any(_alive(p) for p in [proc.pid, *tree]):
                    break
            proc.poll()
        with self._lock:
            self.procs.clear()
        state = self.state_dir / "serve.json"
        if state.exists():
            state.unlink()
        return killed

    def __enter__(self) -> "Stack":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_forever(opts: ServeOptions, say: Callable[[str], None] = print) -> int:
    """Start the stack, print the URLs, wait for Ctrl-C/SIGTERM (or a child's death), stop. Exit code."""
    stop = threading.Event()
    handler = lambda signum, frame: stop.set()  # noqa: E731
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    stack = Stack(opts, say)
    try:
        say(f"starting Prefect server, MLflow server and worker (logs in {stack.log_dir}) ...")
        urls = stack.start()
        say(f"Prefect UI   {urls['prefect_ui']}")
        say(f"Prefect API  {urls['prefect_api']}")
        say(f"MLflow UI    {urls['mlflow_ui']}   (tracking store: {opts.mlflow_backend or stack.run_root / 'mlflow.db'})")
        say(f"work pool    {opts.pool} ({'worker running' if opts.worker else 'no worker'}); "
            f"deployments: rl-train/rl-train, retrain/retrain, eval-gate/eval-gate")
        say("Ctrl-C stops everything.")
        why = stack.wait(stop)
        say(f"stopping ({why.splitlines()[0]}) ...")
        return 0 if why == "stop requested" else 1
    finally:
        stack.stop()
        for s, h in old.items():
            signal.signal(s, h)
        say("stopped.")
