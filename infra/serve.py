"""``deltaloop serve``: the operations stack on one host — Prefect server, worker, MLflow server.

Starts, on loopback by default, each as a child process in its own process group:

1. ``prefect server start`` (API + UI; its database under ``PREFECT_HOME`` or ``--prefect-db``);
2. ``mlflow server`` with the model registry. By default it serves the *same* sqlite store and
   artifact folder that runs write under ``run_root`` (``<run_root>/mlflow.db``,
   ``<run_root>/mlartifacts``), so flows need no tracking server to be up and the UI shows every
   run; ``--mlflow-backend`` / ``--mlflow-artifacts`` take a Postgres URI / an ``s3://`` root
   instead (then configs set ``tracking.uri`` to the server's URL);
3. with ``champion`` (``--champion``), the champion server (:mod:`infra.ops.champion_server`): the
   registered model's ``champion`` alias over an OpenAI-compatible endpoint, read through this MLflow
   server and swapped to the new version whenever the alias moves;
4. the ``deltaloop-process`` work pool, ``prefect deploy --all`` of ``prefect.yaml``, and a worker.

It then prints the URLs and waits. Ctrl-C (SIGINT) or SIGTERM stops every child — worker first,
so running flow runs are cancelled while the servers are still up — by process group, then kills
any descendant that escaped its group (:func:`infra.proc.stop_processes`). Prefect is driven only
through its CLI (no import here).

Auth: with an auth string ``user:password`` (from ``PREFECT_SERVER_API_AUTH_STRING`` or a file,
never from the command line, so ``ps`` never shows it) the Prefect API requires it as HTTP basic
auth, and MLflow runs as its ``basic-auth`` app with ``user`` as admin (password from the same
string), so an anonymous request cannot read runs or move the registry alias that gates
production; the champion endpoint takes the same string as HTTP basic auth or, for OpenAI
clients, the bearer key derived from it (written to ``<state>/champion-api-key``, mode 600).
Without one, ``serve`` binds loopback only. Each child gets only the secrets it needs:
the servers their own settings, the worker (and so every flow run) the client credentials
(``PREFECT_API_AUTH_STRING``, ``MLFLOW_TRACKING_USERNAME``/``PASSWORD``), the champion server the
MLflow client credentials and the auth string it checks (``DELTALOOP_CHAMPION_AUTH``). The process work pool is
created with a base job template that fixes the command, environment and working directory and
forbids other job variables, so a flow run created through the API cannot change what the worker
executes (Prefect answers 422).

Ports: the Prefect and MLflow servers cannot report a port they bound themselves, so a port of 0
is chosen here (:func:`infra.proc.free_port`); if another process takes it before the server binds
it, the server is started again on a fresh port (twice at most).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from infra.atomicio import write_atomic, write_json_atomic
from infra.errors import DeltaloopError
from infra.proc import (ServiceDied, ServiceProcess, ServiceSpec, bind_socket, describe_exit, free_port,
                        http_probe, port_in_use, spawn, wait_until)
from infra.process_env import state_dir
from infra.secrets import derive_key

POOL = "deltaloop-process"
MLFLOW_UI_ENV = "DELTALOOP_MLFLOW_UI_URL"
AUTH_ENV = "PREFECT_SERVER_API_AUTH_STRING"
CHAMPION_AUTH_ENV = "DELTALOOP_CHAMPION_AUTH"  # the auth string the champion server checks (never argv)
# never inherited by a child: each gets the ones its role needs (_child_env)
SECRET_ENVS = ("PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME",
               "MLFLOW_TRACKING_PASSWORD", "MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_AUTH_ADMIN_PASSWORD",
               "MLFLOW_FLASK_SERVER_SECRET_KEY", "MLFLOW_AUTH_CONFIG_PATH", CHAMPION_AUTH_ENV)
MIN_PASSWORD = 12  # MLflow's minimum for a user's password
# The process pool's base job template: command, env and working_dir are fixed (the worker's own
# environment, the default command, the directory the deployment was made in); only harmless
# variables are templated and no others are accepted, so a flow run's job_variables cannot run a
# command of the caller's choosing.
LOCKED_PROCESS_TEMPLATE: dict = {
    "job_configuration": {"command": None, "env": {}, "working_dir": None, "labels": "{{ labels }}",
                          "name": "{{ name }}", "stream_output": "{{ stream_output }}"},
    "variables": {"type": "object", "additionalProperties": False, "properties": {
        "name": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Name"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}, "title": "Labels"},
        "stream_output": {"type": "boolean", "default": True, "title": "Stream Output"}}},
}


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
    worker_limit: int = 4  # flow runs the worker admits; capacity limits (flows/capacity.py) queue them
    api_auth_string: str | None = None  # "user:password": basic auth on the Prefect API and MLflow (admin)
    champion: bool = False  # also serve NAME@alias over the OpenAI API (infra.ops.champion_server)
    champion_port: int = 8000  # 0 = any free port
    champion_model: str = "deltaloop-policy"  # registered model name (tracking.registered_model)
    champion_alias: str = "champion"
    champion_engine: str = "local"  # local (CPU / one GPU) or vllm (vLLM's server; its interpreter)
    champion_poll_s: float = 2.0  # seconds between reads of the alias
    champion_python: str | None = None  # its interpreter (vLLM's for engine vllm); default: this one
    extra_env: dict[str, str] = field(default_factory=dict)


def _port(host: str, port: int, what: str) -> int:
    """``port``, checked to be free now; 0 picks a free one."""
    if port == 0:
        return free_port(host)
    try:
        bind_socket(host, port).close()
    except OSError:
        raise ServeError(f"{what} port {host}:{port} is in use (choose another, or 0 for any free port)") from None
    return port


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is reachable only from this machine."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def split_auth(auth: str) -> tuple[str, str]:
    """``user:password`` -> (user, password), or :class:`ServeError` saying what a valid one is."""
    user, sep, password = auth.strip().partition(":")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.@-]{1,64}", user) or len(password) < MIN_PASSWORD:
        raise ServeError(f"the auth string must be 'user:password' (user: letters, digits, '_.@-'; password: "
                         f"at least {MIN_PASSWORD} characters, MLflow's minimum)")
    return user, password


def read_auth(auth_file: Path | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The auth string from ``auth_file`` (owner-only permissions), else ``$PREFECT_SERVER_API_AUTH_STRING``."""
    env = os.environ if environ is None else environ
    if auth_file is None:
        return env.get(AUTH_ENV) or None
    try:
        mode = auth_file.stat().st_mode
        text = auth_file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ServeError(f"cannot read the auth file {auth_file}: {exc}") from None
    if mode & 0o077:
        raise ServeError(f"the auth file {auth_file} is open to other users (mode {mode & 0o777:o}): chmod 600 it")
    if not text:
        raise ServeError(f"the auth file {auth_file} is empty")
    return text


def champion_api_key(auth: str) -> str:
    """The champion endpoint's bearer key for the auth string ``auth`` (hex; an OpenAI client's
    ``api_key``): derived, so it opens neither the Prefect API nor MLflow."""
    return derive_key(auth.encode(), "champion-api").hex()


def _bin(name: str) -> str:
    """The console script next to this interpreter (the venv's), else on PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


class Stack:
    """The running processes of ``deltaloop serve``; a context manager that always stops them."""

    def __init__(self, opts: ServeOptions, say: Callable[[str], None] = print) -> None:
        self.opts = opts
        self.say = say
        self.procs: dict[str, ServiceProcess] = {}
        self.urls: dict[str, str] = {}
        state = opts.state_dir or state_dir() / "serve"
        self.state_dir = Path(state).resolve()
        self.log_dir = self.state_dir / "logs"
        self.project_dir = Path(opts.project_dir).resolve()
        self.run_root = (self.project_dir / opts.run_root).resolve()
        self.env: dict[str, str] = {}
        self.auth: tuple[str, str] | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------ start
    def start(self) -> dict[str, str]:
        """Start everything, deploy, return the URLs. On failure, stops what started and raises."""
        o = self.opts
        if not o.api_auth_string and not is_loopback(o.host):
            raise ServeError(f"refusing to serve on {o.host} without auth: other machines could drive the Prefect "
                             f"API and move the MLflow alias; set ${AUTH_ENV} or --auth-file, or bind 127.0.0.1")
        self.auth = split_auth(o.api_auth_string) if o.api_auth_string else None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.run_root.mkdir(parents=True, exist_ok=True)
        if self.auth:
            self._mlflow_auth_config()
        ports = {"prefect-server": _port(o.host, o.prefect_port, "Prefect"),
                 "mlflow-server": _port(o.host, o.mlflow_port, "MLflow")}
        self._set_env(ports)
        try:
            for name, port in ports.items():
                self._spawn(name, self._server_cmd(name, port))
            for name, wanted in (("prefect-server", o.prefect_port), ("mlflow-server", o.mlflow_port)):
                self._wait_server(name, ports, auto_port=wanted == 0)
            if self.auth:
                self._check_mlflow_admin()
            if o.champion:
                self._start_champion()
            template = self.state_dir / "process-pool.json"
            write_json_atomic(template, LOCKED_PROCESS_TEMPLATE, indent=2)
            self._cli("work pool", [_bin("prefect"), "work-pool", "create", o.pool, "--type", "process",
                                    "--base-job-template", str(template), "--overwrite"])
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

    def _set_env(self, ports: dict[str, int]) -> None:
        """URLs and the environment of every child, for the servers' ``ports``."""
        o = self.opts
        api = f"http://{o.host}:{ports['prefect-server']}/api"
        self.urls = {"prefect_ui": f"http://{o.host}:{ports['prefect-server']}", "prefect_api": api,
                     "mlflow_ui": f"http://{o.host}:{ports['mlflow-server']}"}
        base = {k: v for k, v in {**os.environ, **o.extra_env}.items() if k not in SECRET_ENVS}
        self.env = {**base, "PREFECT_API_URL": api, MLFLOW_UI_ENV: self.urls["mlflow_ui"],
                    "PREFECT_UI_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "NO_PROXY": ",".join(filter(None, [os.environ.get("NO_PROXY"), o.host, "localhost"]))}
        # MLflow's background job runner (GenAI jobs; three huey consumers) is not used here
        self.env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
        # capacity leases (flows/capacity.py) on disk under PREFECT_HOME, so a restarted server still
        # knows which run holds which slot and frees the slots of a run that died meanwhile
        self.env.setdefault("PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE",
                            "prefect.server.concurrency.lease_storage.filesystem")
        if self.auth:  # the clients' credentials: CLI calls, the worker and every flow run it starts
            self.env["PREFECT_API_AUTH_STRING"] = ":".join(self.auth)
            self.env["MLFLOW_TRACKING_USERNAME"], self.env["MLFLOW_TRACKING_PASSWORD"] = self.auth
        if o.prefect_db:
            self.env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = o.prefect_db

    def _child_env(self, name: str) -> dict[str, str]:
        """The environment of child ``name``: the common one plus the secrets of its role only."""
        if not self.auth:
            return self.env
        if name == "prefect-server":
            return {**self.env, AUTH_ENV: ":".join(self.auth)}
        if name == "champion":
            env = {k: v for k, v in self.env.items() if k != "PREFECT_API_AUTH_STRING"}
            return {**env, CHAMPION_AUTH_ENV: ":".join(self.auth)}
        if name == "mlflow-server":
            env = {k: v for k, v in self.env.items() if not k.startswith("MLFLOW_TRACKING_")}
            return {**env, "MLFLOW_AUTH_CONFIG_PATH": str(self.state_dir / "mlflow-auth.ini"),
                    "MLFLOW_AUTH_ADMIN_USERNAME": self.auth[0], "MLFLOW_AUTH_ADMIN_PASSWORD": self.auth[1],
                    "MLFLOW_FLASK_SERVER_SECRET_KEY": derive_key(":".join(self.auth).encode(), "mlflow-csrf").hex()}
        return self.env

    def _mlflow_auth_config(self) -> None:
        """Write MLflow's auth config (no secret in it) and set the admin password of an existing auth db.

        MLflow creates its admin user from ``MLFLOW_AUTH_ADMIN_PASSWORD`` only when the user does not
        exist yet, so after the auth string changes the stored password is replaced here, before the
        server starts.
        """
        assert self.auth is not None
        db = self.state_dir / "mlflow-auth.db"
        ini = self.state_dir / "mlflow-auth.ini"
        write_atomic(ini, "[mlflow]\ndefault_permission = READ\n"
                     f"database_uri = sqlite:///{db}\nadmin_username = {self.auth[0]}\n"
                     "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n", mode=0o600)
        if not db.exists():
            return
        from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore

        store = SqlAlchemyStore()
        store.init_db(f"sqlite:///{db}")
        try:
            user, password = self.auth
            if store.has_user(user) and not store.authenticate_user(user, password):
                store.update_user(user, password=password, is_admin=True)
        finally:
            store.engine.dispose()

    def _server_cmd(self, name: str, port: int) -> list[str]:
        o = self.opts
        if name == "prefect-server":
            return [_bin("prefect"), "server", "start", "--host", o.host, "--port", str(port)]
        backend = o.mlflow_backend or f"sqlite:///{self.run_root / 'mlflow.db'}"
        artifacts = o.mlflow_artifacts or str(self.run_root / "mlartifacts")
        auth = ["--app-name", "basic-auth"] if self.auth else []
        return [_bin("mlflow"), "server", *auth, "--host", o.host, "--port", str(port), "--backend-store-uri", backend,
                "--default-artifact-root", artifacts, "--artifacts-destination", artifacts, "--workers", "1"]

    def _wait_server(self, name: str, ports: dict[str, int], auto_port: bool, attempts: int = 3) -> None:
        """Wait for a server's health URL; an auto-chosen port taken meanwhile gets a fresh one."""
        for attempt in range(attempts):
            url = self.urls["prefect_api"] if name == "prefect-server" else self.urls["mlflow_ui"]
            try:
                self._wait_http(name, f"{url}/health", 180)
                return
            except ServeError as exc:
                if not auto_port or attempt == attempts - 1 or not port_in_use(str(exc)):
                    raise
            ports[name] = free_port(self.opts.host)
            self._set_env(ports)
            self._spawn(name, self._server_cmd(name, ports[name]))

    def _start_champion(self) -> None:
        """Start the champion server on the MLflow server's registry; wait until it answers."""
        o = self.opts
        port = _port(o.host, o.champion_port, "champion") if o.champion_port else 0
        state = self.state_dir / "champion.json"
        state.unlink(missing_ok=True)
        python = o.champion_python or sys.executable
        self._spawn("champion", [python, "-m", "infra.ops.champion_server", "--tracking-uri", self.urls["mlflow_ui"],
                                 "--model", o.champion_model, "--alias", o.champion_alias, "--host", o.host,
                                 "--port", str(port), "--engine", o.champion_engine, "--poll", str(o.champion_poll_s),
                                 "--workdir", str(self.state_dir / "champion"), "--state-file", str(state)])
        proc = self.procs["champion"]
        try:
            wait_until(lambda: state.exists(), 300, proc.dead_reason, "champion server", interval=0.5)
        except ServiceDied as exc:
            raise ServeError(f"{exc}\n{proc.tail()}") from None
        url = f"http://{o.host}:{json.loads(state.read_text())['port']}"
        self._wait_http("champion", f"{url}/health", 60)
        self.urls["champion"] = f"{url}/v1"
        if self.auth:
            write_atomic(self.state_dir / "champion-api-key", champion_api_key(":".join(self.auth)) + "\n",
                         mode=0o600)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        # no lifeline: DELTALOOP_PARENT_PID would reach flow runs and tie their services to this process
        spec = ServiceSpec(name=name, argv=cmd, env=self._child_env(name), cwd=str(self.project_dir),
                           log=str(self.log_dir / f"{name}.log"), inherit_env=False, lifeline=False)
        with self._lock:
            self.procs[name] = spawn(spec)

    def _wait_http(self, name: str, url: str, timeout: float) -> None:
        proc = self.procs[name]
        try:
            wait_until(http_probe(url, self._auth_header()), timeout, proc.dead_reason, name, interval=0.5)
        except ServiceDied as exc:
            if proc.poll() is not None:
                raise ServeError(str(exc)) from None
            raise ServeError(f"{name} did not answer {url} within {timeout:.0f}s:\n{proc.tail()}") from None

    def _auth_header(self) -> dict[str, str]:
        import base64

        return {"Authorization": "Basic " + base64.b64encode(":".join(self.auth).encode()).decode()} if self.auth else {}

    def _check_mlflow_admin(self) -> None:
        """Fail now, not at a flow's first registry call, if MLflow refuses the admin credentials."""
        import urllib.error
        import urllib.request

        url = f"{self.urls['mlflow_ui']}/api/2.0/mlflow/experiments/search?max_results=1"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            opener.open(urllib.request.Request(url, headers=self._auth_header()), timeout=30).close()
        except urllib.error.HTTPError as exc:
            raise ServeError(f"MLflow refused the admin credentials ({exc.code}) with the auth database "
                             f"{self.state_dir / 'mlflow-auth.db'}") from None

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
        write_json_atomic(self.state_dir / "serve.json", state, indent=2)  # readers never see half of it

    # ------------------------------------------------------------------------------ run / stop
    def dead(self) -> str | None:
        """Name and exit status of a child that stopped on its own, if any."""
        for name, p in list(self.procs.items()):
            code = p.poll()
            if code is not None:
                return f"{name} stopped: {describe_exit(code)}"
        return None

    def wait(self, stop: threading.Event, poll: float = 1.0) -> str:
        """Block until ``stop`` is set or a child dies; returns why."""
        while not stop.wait(poll):
            why = self.dead()
            if why:
                return why + ":\n" + self.procs[why.split()[0]].tail()
        return "stop requested"

    def stop(self, grace: float = 20.0) -> list[int]:
        """Stop every child (reverse start order) and their descendants. Returns pids that needed SIGKILL."""
        killed: list[int] = []
        with self._lock:
            items = list(self.procs.items())[::-1]
        for _name, proc in items:
            killed += proc.terminate(timeout=grace)
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
        if "champion" in urls:
            say(f"champion     {urls['champion']}   (OpenAI API: {opts.champion_model}@{opts.champion_alias}, "
                f"follows the alias)")
        say(f"work pool    {opts.pool} ({'worker running' if opts.worker else 'no worker'}); "
            f"deployments: rl-train/rl-train, retrain/retrain, eval-gate/eval-gate")
        say("auth: the Prefect API and MLflow require the auth string (HTTP basic)" if stack.auth
            else f"no auth: anyone on this machine can use both servers ({opts.host} only)")
        say("Ctrl-C stops everything.")
        why = stack.wait(stop)
        say(f"stopping ({why.splitlines()[0]}) ...")
        return 0 if why == "stop requested" else 1
    finally:
        stack.stop()
        for s, h in old.items():
            signal.signal(s, h)
        say("stopped.")
