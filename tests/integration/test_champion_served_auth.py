"""``deltaloop serve --champion`` with auth: the champion endpoint of the ops stack.

A tiny policy is registered as ``champion`` in the stack's own store (under ``--run-root``); the
stack (Prefect server, MLflow server with basic auth, champion server; no worker, no deploy) must
serve it over the OpenAI API through the MLflow server, refuse anonymous requests (401), accept
the auth string as HTTP basic auth and the derived key (``<state>/serve/champion-api-key``) as a
bearer token, keep ``/health`` open, and never show the secret on a command line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.champion import register_policies
from infra.proc import descendants
from infra.registry import Registry

ROOT = Path(__file__).resolve().parents[2]
USER, PASSWORD = "deltaloop", "champion-secret-for-tests"


@pytest.mark.slow
def test_serve_champion_with_auth(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    uri = f"sqlite:///{runs / 'mlflow.db'}"
    (v1,) = register_policies(uri, runs, seeds=(0,))
    Registry(uri, "deltaloop-policy").point("champion", v1)
    auth_file = tmp_path / "auth"
    auth_file.write_text(f"{USER}:{PASSWORD}\n")
    auth_file.chmod(0o600)
    env = {**os.environ, "DELTALOOP_STATE": str(tmp_path / "state"), "PREFECT_HOME": str(tmp_path / "prefect")}
    for name in ("PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME",
                 "MLFLOW_TRACKING_PASSWORD"):
        env.pop(name, None)
    out = tmp_path / "serve.out"
    with open(out, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deltaloop.cli", "serve", "--prefect-port", "0", "--mlflow-port", "0",
             "--run-root", str(runs), "--no-worker", "--no-deploy", "--auth-file", str(auth_file),
             "--champion", "--champion-port", "0"], cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    state_file = tmp_path / "state" / "serve" / "serve.json"
    try:
        deadline = time.monotonic() + 400
        while not state_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-4000:]
            time.sleep(0.5)
        state = json.loads(state_file.read_text())
        base = state["urls"]["champion"]
        key = (tmp_path / "state" / "serve" / "champion-api-key").read_text().strip()
        chat = {"model": "deltaloop-policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        with httpx.Client(trust_env=False, timeout=60) as http:
            assert http.get(base.removesuffix("/v1") + "/health").json()["version"] == v1
            assert http.post(f"{base}/chat/completions", json=chat).status_code == 401
            assert http.post(f"{base}/chat/completions", json=chat,
                             headers={"Authorization": "Bearer wrong"}).status_code == 401
            r = http.post(f"{base}/chat/completions", json=chat, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200 and r.headers["x-deltaloop-model-version"] == v1, r.text
            assert r.json()["weight_version"] == int(v1)
            r = http.get(f"{base}/models", auth=(USER, PASSWORD))
            assert r.status_code == 200 and r.json()["data"][0]["version"] == v1
        pids = {proc.pid, *state["pids"].values()}
        pids |= {d for p in list(pids) for d in descendants(p)}
        lines = []
        for pid in pids:
            try:
                lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                continue
        assert any("infra.ops.champion_server" in line for line in lines)
        assert not any(PASSWORD in line or key in line for line in lines)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    assert "stopped." in out.read_text()
