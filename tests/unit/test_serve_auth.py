"""``deltaloop serve``'s auth rules without starting servers (issue #15, finding 6).

The stack with real servers is tested in ``tests/integration/test_api_auth.py``; here the decisions
that must hold before any process starts: no exposure beyond loopback without auth, the auth
string never from argv and only from an owner-only file, each child given only its own secrets.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from infra.serve import (LOCKED_PROCESS_TEMPLATE, SECRET_ENVS, ServeError, ServeOptions, Stack, is_loopback,
                         read_auth, split_auth)

ROOT = Path(__file__).resolve().parents[2]
AUTH = "ops:correct-horse-battery"


def test_non_loopback_without_auth_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """Finding 6: ``serve --host 0.0.0.0`` used to expose an open Prefect API and MLflow registry."""
    stack = Stack(ServeOptions(host="0.0.0.0", prefect_port=0, mlflow_port=0, project_dir=tmp_path,
                               state_dir=tmp_path / "state"))
    with pytest.raises(ServeError, match="refusing to serve on 0.0.0.0 without auth"):
        stack.start()
    assert not stack.procs and not (tmp_path / "state").exists()
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("no-such-host.invalid")


def test_auth_string_never_from_argv() -> None:
    """Finding 6: the auth string was an option, so ``ps`` showed it to every user of the host."""
    out = subprocess.run([sys.executable, "-m", "deltaloop.cli", "serve", "--api-auth-string", AUTH, "--no-worker"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "No such option" in out.stderr + out.stdout


def test_auth_file_must_be_owner_only(tmp_path: Path) -> None:
    f = tmp_path / "auth"
    f.write_text(AUTH + "\n")
    f.chmod(0o644)
    with pytest.raises(ServeError, match="open to other users .*chmod 600"):
        read_auth(f)
    f.chmod(0o600)
    assert read_auth(f) == AUTH
    assert read_auth(None, {"PREFECT_SERVER_API_AUTH_STRING": AUTH}) == AUTH and read_auth(None, {}) is None
    with pytest.raises(ServeError, match="cannot read the auth file"):
        read_auth(tmp_path / "missing")
    for bad in ("nopassword", "ops:short", ":correct-horse-battery", "o ps:correct-horse-battery"):
        with pytest.raises(ServeError, match="must be 'user:password'"):
            split_auth(bad)
    assert split_auth(AUTH) == ("ops", "correct-horse-battery")


def test_each_child_gets_only_its_own_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The MLflow admin password and Flask key reach only MLflow; the worker gets client credentials."""
    for name in SECRET_ENVS:
        monkeypatch.setenv(name, "inherited-" + name)
    stack = Stack(ServeOptions(api_auth_string=AUTH, project_dir=tmp_path, state_dir=tmp_path / "state"))
    stack.auth = split_auth(AUTH)
    stack._set_env({"prefect-server": 4200, "mlflow-server": 5000})
    worker, prefect, mlflow = (stack._child_env(n) for n in ("worker", "prefect-server", "mlflow-server"))
    assert not any(v.startswith("inherited-") for env in (worker, prefect, mlflow) for v in env.values())
    assert worker["PREFECT_API_AUTH_STRING"] == AUTH and worker["MLFLOW_TRACKING_PASSWORD"] == "correct-horse-battery"
    assert not {"PREFECT_SERVER_API_AUTH_STRING", "MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"} & set(worker)
    assert prefect["PREFECT_SERVER_API_AUTH_STRING"] == AUTH and "MLFLOW_AUTH_ADMIN_PASSWORD" not in prefect
    assert mlflow["MLFLOW_AUTH_ADMIN_USERNAME"] == "ops" and mlflow["MLFLOW_AUTH_ADMIN_PASSWORD"] == "correct-horse-battery"
    assert "MLFLOW_TRACKING_PASSWORD" not in mlflow and len(mlflow["MLFLOW_FLASK_SERVER_SECRET_KEY"]) == 64
    cmd = stack._server_cmd("mlflow-server", 5000)
    assert cmd[2:4] == ["--app-name", "basic-auth"] and AUTH not in " ".join(cmd)


def test_process_pool_template_accepts_no_command() -> None:
    """Finding 6: a flow run's job_variables could set the process worker's command, env or folder."""
    conf, variables = LOCKED_PROCESS_TEMPLATE["job_configuration"], LOCKED_PROCESS_TEMPLATE["variables"]
    assert conf["command"] is None and conf["env"] == {} and conf["working_dir"] is None
    assert variables["additionalProperties"] is False
    assert not {"command", "env", "working_dir"} & set(variables["properties"])
