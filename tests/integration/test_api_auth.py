"""A Prefect API protected by ``PREFECT_SERVER_API_AUTH_STRING`` refuses unauthenticated triggers.

Starts ``deltaloop serve --api-auth-string user:pass --no-worker`` (a real Prefect server; serve's
own work-pool and deploy steps must authenticate to succeed), then creates an ``rl-train`` run
through the REST API without and with credentials.
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

from infra.ops.trigger import request, trigger

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
AUTH = "deltaloop:s3cret-token"


def test_unauthenticated_trigger_is_refused(tmp_path: Path) -> None:
    env = {**os.environ, "DELTALOOP_STATE": str(tmp_path / "state"), "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_SERVER_API_AUTH_STRING", None)
    env.pop("PREFECT_API_AUTH_STRING", None)
    out = tmp_path / "serve.out"
    with open(out, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deltaloop.cli", "serve", "--prefect-port", "0", "--mlflow-port", "0",
             "--run-root", str(tmp_path / "runs"), "--no-worker", "--api-auth-string", AUTH],
            cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    state_file = tmp_path / "state" / "serve" / "serve.json"
    try:
        deadline = time.monotonic() + 300
        while not state_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-4000:]
            time.sleep(0.5)
        api = json.loads(state_file.read_text())["urls"]["prefect_api"]
        params = {"config": "configs/demo.yaml", "overrides": [f"run_root={tmp_path / 'runs'}"]}
        # no credentials: refused, before any deployment lookup
        r = httpx.get(f"{api}/deployments/name/rl-train/rl-train", trust_env=False, timeout=30)
        assert r.status_code == 401
        with pytest.raises(httpx.HTTPStatusError) as info:
            trigger(api, "rl-train/rl-train", params)
        assert info.value.response.status_code == 401
        with pytest.raises(httpx.HTTPStatusError):
            trigger(api, "rl-train/rl-train", params, auth="deltaloop:wrong")
        # with the shared secret the same call creates the run
        run = trigger(api, "rl-train/rl-train", params, auth=AUTH)
        assert run["state"]["type"] == "SCHEDULED" and run["parameters"] == params
        with httpx.Client(base_url=api + "/", auth=tuple(AUTH.split(":", 1)), trust_env=False, timeout=30) as c:
            r = request(c, "POST", f"flow_runs/{run['id']}/set_state",
                        json={"state": {"type": "CANCELLED", "name": "Cancelled"}, "force": True})
        assert r.status_code in (200, 201)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    assert "stopped." in out.read_text()
