"""``deltaloop serve`` with auth: the Prefect API and the MLflow registry refuse anonymous requests.

Starts ``deltaloop serve --auth-file FILE --no-worker`` (a real Prefect server and a real MLflow
server running MLflow's ``basic-auth`` app; serve's own work-pool and deploy steps must
authenticate to succeed), then replays issue #15, finding 6 against it: triggers without and with
credentials, a flow run whose job variables name a command, an anonymous move of the registry
alias that gates production, and a look at every process's command line for the secret.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from infra.ops.trigger import request, trigger
from infra.proc import descendants

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
USER, PASSWORD = "deltaloop", "s3cret-token-for-tests"
AUTH = f"{USER}:{PASSWORD}"


def _env(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "DELTALOOP_STATE": str(tmp / "state"), "PREFECT_HOME": str(tmp / "prefect")}
    for name in ("PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME",
                 "MLFLOW_TRACKING_PASSWORD"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("auth")
    auth_file = tmp / "auth"
    auth_file.write_text(AUTH + "\n")
    auth_file.chmod(0o600)
    out = tmp / "serve.out"
    with open(out, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deltaloop.cli", "serve", "--prefect-port", "0", "--mlflow-port", "0",
             "--run-root", str(tmp / "runs"), "--no-worker", "--auth-file", str(auth_file)],
            cwd=ROOT, env=_env(tmp), stdout=fh, stderr=subprocess.STDOUT)
    state_file = tmp / "state" / "serve" / "serve.json"
    try:
        deadline = time.monotonic() + 300
        while not state_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-4000:]
            time.sleep(0.5)
        yield {"proc": proc, "tmp": tmp, **json.loads(state_file.read_text())}
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    assert "stopped." in out.read_text()


def test_non_loopback_without_auth_is_refused(tmp_path: Path) -> None:
    """Finding 6: ``serve --host 0.0.0.0`` without auth would expose both servers to the network."""
    out = subprocess.run([sys.executable, "-m", "deltaloop.cli", "serve", "--host", "0.0.0.0", "--no-worker",
                          "--prefect-port", "0", "--mlflow-port", "0"],
                         cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "refusing to serve on 0.0.0.0 without auth" in out.stderr
    assert not (tmp_path / "state" / "serve" / "serve.json").exists()


def test_no_process_shows_the_secret(stack: dict[str, Any]) -> None:
    """Finding 6: the auth string was on serve's command line, readable by every user through ``ps``."""
    pids = {stack["proc"].pid, *stack["pids"].values()}
    pids |= {d for p in list(pids) for d in descendants(p)}
    lines = []
    for pid in sorted(pids):
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    assert len(lines) >= 3, lines  # serve, Prefect server, MLflow server (+ its uvicorn worker)
    assert any("basic-auth" in line for line in lines), lines
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert PASSWORD not in ps and not any(PASSWORD in line for line in lines)


def test_prefect_api_refuses_unauthenticated_triggers(stack: dict[str, Any]) -> None:
    api = stack["urls"]["prefect_api"]
    params = {"config": "configs/demo.yaml", "overrides": ["trainer.steps=1"]}
    r = httpx.get(f"{api}/deployments/name/rl-train/rl-train", trust_env=False, timeout=30)
    assert r.status_code == 401
    with pytest.raises(httpx.HTTPStatusError) as info:
        trigger(api, "rl-train/rl-train", params)
    assert info.value.response.status_code == 401
    with pytest.raises(httpx.HTTPStatusError):
        trigger(api, "rl-train/rl-train", params, auth=f"{USER}:wrong-password-12")
    run = trigger(api, "rl-train/rl-train", params, auth=AUTH)  # with the shared secret: created
    assert run["state"]["type"] == "SCHEDULED" and run["parameters"] == params
    with httpx.Client(base_url=api + "/", auth=(USER, PASSWORD), trust_env=False, timeout=30) as c:
        r = request(c, "POST", f"flow_runs/{run['id']}/set_state",
                    json={"state": {"type": "CANCELLED", "name": "Cancelled"}, "force": True})
    assert r.status_code in (200, 201)


def test_flow_run_job_variables_cannot_name_a_command(stack: dict[str, Any]) -> None:
    """Finding 6: ``job_variables: {command: ...}`` on a flow run made the process worker run it."""
    api = stack["urls"]["prefect_api"]
    marker = stack["tmp"] / "job-variables-ran"
    with httpx.Client(base_url=api + "/", auth=(USER, PASSWORD), trust_env=False, timeout=30) as c:
        dep = request(c, "GET", "deployments/name/rl-train/rl-train").json()
        for jv in ({"command": f"touch {marker}"}, {"env": {"DELTALOOP_API_OVERRIDES": "cluster.*"}},
                   {"working_dir": "/tmp"}):
            r = c.post(f"deployments/{dep['id']}/create_flow_run",
                       json={"parameters": {"config": "configs/demo.yaml"}, "job_variables": jv})
            assert r.status_code == 422, (jv, r.status_code, r.text[:300])
        pool = request(c, "GET", "work_pools/deltaloop-process").json()
    assert pool["base_job_template"]["job_configuration"]["command"] is None
    assert not marker.exists()


def test_mlflow_alias_cannot_be_moved_anonymously(stack: dict[str, Any]) -> None:
    """Finding 6: MLflow was open, so anyone reaching it could point ``champion`` at any version."""
    base = stack["urls"]["mlflow_ui"] + "/api/2.0/mlflow/"
    anon = httpx.Client(base_url=base, trust_env=False, timeout=30)
    admin = httpx.Client(base_url=base, auth=(USER, PASSWORD), trust_env=False, timeout=30)
    with anon, admin:
        assert anon.get("experiments/search", params={"max_results": 1}).status_code == 401
        assert anon.post("registered-models/create", json={"name": "m"}).status_code == 401
        assert admin.post("registered-models/create", json={"name": "m"}).status_code == 200
        exp = admin.post("experiments/create", json={"name": "auth-test"}).json()["experiment_id"]
        run = admin.post("runs/create", json={"experiment_id": exp}).json()["run"]["info"]
        for _ in range(2):
            r = admin.post("model-versions/create", json={"name": "m", "run_id": run["run_id"],
                                                          "source": f"{run['artifact_uri']}/model"})
            assert r.status_code == 200, r.text
        move = {"name": "m", "alias": "champion", "version": "1"}
        assert anon.post("registered-models/alias", json=move).status_code == 401
        assert admin.get("registered-models/alias", params={"name": "m", "alias": "champion"}).status_code != 200
        assert admin.post("registered-models/alias", json=move).status_code == 200
        assert anon.post("registered-models/alias", json={**move, "version": "2"}).status_code == 401
        assert anon.request("DELETE", "registered-models/alias", params={"name": "m", "alias": "champion"}
                            ).status_code == 401
        got = admin.get("registered-models/alias", params={"name": "m", "alias": "champion"}).json()
        assert got["model_version"]["version"] == "1"


def test_changed_auth_string_replaces_the_mlflow_admin_password(tmp_path: Path) -> None:
    """MLflow keeps the admin password of its first start; serve sets the current one before each start."""
    env = _env(tmp_path)
    for password in ("first-password-123", "second-password-456"):
        env["PREFECT_SERVER_API_AUTH_STRING"] = f"{USER}:{password}"
        proc = subprocess.Popen([sys.executable, "-m", "deltaloop.cli", "serve", "--prefect-port", "0",
                                 "--mlflow-port", "0", "--run-root", str(tmp_path / "runs"), "--no-worker",
                                 "--no-deploy"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        state_file = tmp_path / "state" / "serve" / "serve.json"
        try:
            deadline = time.monotonic() + 300
            while not state_file.exists():
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
                time.sleep(0.5)
            url = json.loads(state_file.read_text())["urls"]["mlflow_ui"] + "/api/2.0/mlflow/experiments/search"
            now = httpx.get(url, params={"max_results": 1}, auth=(USER, password), trust_env=False, timeout=30)
            old = httpx.get(url, params={"max_results": 1}, auth=(USER, "first-password-123"), trust_env=False,
                            timeout=30)
            assert now.status_code == 200 and old.status_code == (200 if password.startswith("first") else 401)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
