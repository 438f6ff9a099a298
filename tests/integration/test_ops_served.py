"""The operations stack for real: ``deltaloop serve`` (Prefect server + process worker + MLflow server,
``prefect deploy --all``), behind auth, runs triggered through the REST API, a scheduled
``retrain``, an ``eval-gate`` deployment run, the champion loaded with ``transformers`` from the
registry, an API-triggered run that asks for a shell refused before anything starts, the Prefect
and MLflow UIs in headless Chromium, and a clean stop on SIGINT.

The stack runs as an operator would expose it: ``PREFECT_SERVER_API_AUTH_STRING`` set (so MLflow
runs its basic-auth app and every client, this test included, authenticates) and the worker's
override allow-list extended with ``run_root`` (``DELTALOOP_API_OVERRIDES``), since each test
triggers runs into its own run_root.

Tests run in file order and share one stack (module fixture): the first run creates the champion
that the later ones retrain from, gate against and look for in the UIs. Screenshots are written to
``test-output/ui/`` (git-ignored). Needs Debian's chromium + chromedriver and selenium
(``scripts/setup_ui_test.sh``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from base64 import b64encode
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from infra.ops.trigger import request, trigger, wait
from infra.proc import descendants

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
USER, PASSWORD = "ops", "served-stack-secret"
AUTH = f"{USER}:{PASSWORD}"
SHOTS = ROOT / "test-output" / "ui"
TINY = [
    "trainer.steps=2", "trainer.prompts_per_step=4", "trainer.group_size=4",
    "warmstart.steps=30", "env.eval_problems=20", "model.tiny.hidden_size=64", "model.tiny.num_layers=2",
    "model.tiny.intermediate_size=128", "model.tiny.num_heads=2",
    "promote.floors={}",  # this tiny model scores ~0.01, below the demo's production floor: plumbing, not quality
]


class Served:
    def __init__(self, proc: subprocess.Popen, state: dict[str, Any], run_root: Path, out: Path) -> None:
        self.proc, self.state, self.run_root, self.out = proc, state, run_root, out
        self.api = state["urls"]["prefect_api"]
        self.ui = state["urls"]["prefect_ui"]
        self.mlflow = state["urls"]["mlflow_ui"]
        self.runs: dict[str, dict[str, Any]] = {}

    def overrides(self, *extra: str) -> list[str]:
        return [*TINY, f"run_root={self.run_root}", *extra]

    def get(self, path: str) -> Any:
        with httpx.Client(base_url=self.api + "/", auth=(USER, PASSWORD), timeout=30, trust_env=False) as c:
            return request(c, "GET", path).json()

    def post(self, path: str, body: Any) -> Any:
        with httpx.Client(base_url=self.api + "/", auth=(USER, PASSWORD), timeout=30, trust_env=False) as c:
            r = request(c, "POST", path, json=body)
        return r.json() if r.content else None


def _all_pids(served: Served) -> list[int]:
    pids = [served.proc.pid, *served.state["pids"].values()]
    return sorted({p for pid in pids for p in (pid, *descendants(pid))})


def start_served(tmp: Path, env_extra: dict[str, str], *args: str) -> Served:
    """``deltaloop serve`` with auth in ``tmp`` (state, Prefect home, run root), ``env_extra`` on
    top of the test settings and ``args`` after the ports; returns once it wrote its state file."""
    env = {**os.environ, "DELTALOOP_STATE": str(tmp / "state"), "PREFECT_HOME": str(tmp / "prefect"),
           "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_LOGGING_LEVEL": "INFO",
           "PREFECT_SERVER_API_AUTH_STRING": AUTH, "DELTALOOP_API_OVERRIDES": "default run_root promote.floors",
           **env_extra}
    out = tmp / "serve.out"
    with open(out, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deltaloop.cli", "serve", "--prefect-port", "0", "--mlflow-port", "0",
             "--run-root", str(tmp / "runs"), *args],
            cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
        )
    state_file = tmp / "state" / "serve" / "serve.json"
    deadline = time.monotonic() + 300
    while not state_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"deltaloop serve did not come up:\n{out.read_text()[-4000:]}")
        time.sleep(0.5)
    return Served(proc, json.loads(state_file.read_text()), tmp / "runs", out)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = start_served(tmp_path_factory.mktemp("served"),
                     {"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",
                      "PREFECT_SERVER_SERVICES_SCHEDULER_RECENT_DEPLOYMENTS_LOOP_SECONDS": "2"})
    proc, out = s.proc, s.out
    state_file = out.parent / "state" / "serve" / "serve.json"
    mp = pytest.MonkeyPatch()  # what a registry consumer sets to reach the served MLflow
    mp.setenv("MLFLOW_TRACKING_USERNAME", USER)
    mp.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    try:
        yield s
    finally:
        mp.undo()
        pids = _all_pids(s)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        stop_s = time.monotonic() - t0
        left = [p for p in pids if Path(f"/proc/{p}").exists()
                and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
        text = out.read_text()
        print(f"serve stopped in {stop_s:.1f}s")
        assert "stopped." in text, text[-2000:]
        assert not left, f"processes left after Ctrl-C: {left}"
        assert not state_file.exists()


def test_api_triggered_rl_train_completes_with_report(served: Served) -> None:
    """The documented Python example: create an rl-train run with parameters via REST, wait for it.

    Every override it sends is on the allow-list (run_root by the operator's extension), so it runs."""
    t0 = time.monotonic()
    run = trigger(served.api, "rl-train/rl-train",
                  {"config": "configs/demo.yaml", "overrides": served.overrides()}, name="api-triggered", auth=AUTH)
    assert run["state"]["type"] == "SCHEDULED"
    done = wait(served.api, run["id"], timeout=900, auth=AUTH)
    assert done["state"]["type"] == "COMPLETED", done["state"]
    print(f"api-triggered rl-train: {time.monotonic() - t0:.1f}s from trigger to COMPLETED")
    served.runs["rl-train"] = done
    arts = served.post("artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}})
    md = [a for a in arts if a["type"] == "markdown" and (a["key"] or "").startswith("run-report-")]
    assert md, [a["key"] for a in arts]
    text = md[0]["data"]
    assert "## Steps" in text and "## Evaluations" in text and "| 2 |" in text
    assert f"{served.mlflow}/#/experiments/" in text  # link to the MLflow run in the served UI
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=served.mlflow)
    rid = text.split("/runs/")[1].split(")")[0]
    names = {a.path for a in client.list_artifacts(rid, "plots")}
    assert "plots/operations.png" in names and "plots/curves.png" in names


def _stack_cmdlines(served: Served) -> list[str]:
    out = []
    for pid in _all_pids(served):
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return out


def test_api_triggered_shell_override_is_refused_before_anything_starts(served: Served) -> None:
    """Finding 6 of issue #15: an API-triggered run set ``cluster.hosts`` with a ``proxy_command``,
    which provision ran on the worker as ``ssh -o ProxyCommand=...`` (here: touching a marker file).

    Both the form that works as an override (a whole ``cluster.hosts`` list) and the issue's
    ``cluster.hosts[0].proxy_command`` must fail the flow run with the refused key and the allow-list
    in its state message, before a run folder, an MLflow run or any ssh process exists.
    """
    marker = served.run_root.parent / "proxy-command-ran"
    attack_root = served.run_root.parent / "attack-runs"
    attacks = {
        "cluster.hosts": [f"cluster.hosts=[{{host: 10.255.255.1, proxy_command: 'touch {marker}'}}]",
                          "cluster.type=hosts", "cluster.ranks=1"],
        "cluster.hosts[0].proxy_command": [f"cluster.hosts[0].proxy_command=touch {marker}"],
    }
    runs = {key: trigger(served.api, "rl-train/rl-train",
                         {"config": "configs/demo.yaml", "overrides": [*TINY, f"run_root={attack_root}", *ov]},
                         name=f"attack-{i}", auth=AUTH)
            for i, (key, ov) in enumerate(attacks.items())}
    for key, run in runs.items():
        done = wait(served.api, run["id"], timeout=600, auth=AUTH)
        msg = done["state"]["message"] or ""
        assert done["state"]["type"] == "FAILED", done["state"]
        assert f"override {key!r} is not allowed" in msg and "trainer.*" in msg, msg
        assert not any("ssh" in line.split(" ", 1)[0] or str(marker) in line for line in _stack_cmdlines(served))
    assert not marker.exists()
    assert not attack_root.exists()  # no run folder, store or MLflow sqlite: nothing was provisioned


def test_champion_loads_with_transformers_from_registry(served: Served, tmp_path: Path) -> None:
    import mlflow
    import mlflow.artifacts
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # what a consumer does: point MLflow at the server, download the alias, open it with transformers
    mlflow.set_tracking_uri(served.mlflow)
    mlflow.set_registry_uri(served.mlflow)
    try:
        folder = mlflow.artifacts.download_artifacts("models:/deltaloop-policy@champion", dst_path=str(tmp_path))
    finally:
        mlflow.set_tracking_uri("")
        mlflow.set_registry_uri("")
    model = AutoModelForCausalLM.from_pretrained(Path(folder) / "model")  # the transformers flavour's folder
    tok = AutoTokenizer.from_pretrained(Path(folder) / "model")
    ids = tok("f(x)=", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def test_scheduled_retrain_fires_and_starts_from_champion(served: Served) -> None:
    dep = served.get("deployments/name/retrain/retrain")
    assert any(s["schedule"].get("cron") == "0 3 * * *" for s in dep["schedules"])  # from prefect.yaml
    anchor = (datetime.now(timezone.utc) + timedelta(seconds=8)).isoformat()
    params = {"config": "configs/demo.yaml", "overrides": served.overrides("trainer.steps=1"), "allow_scratch": False}
    added = served.post(f"deployments/{dep['id']}/schedules",
                        [{"schedule": {"interval": 3600, "anchor_date": anchor}, "active": True, "parameters": params}])
    sched_id = added[0]["id"]
    fired = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and fired is None:
        runs = served.post("flow_runs/filter", {"deployments": {"id": {"any_": [dep["id"]]}},
                                                "flow_runs": {"state": {"type": {"not_any_": ["SCHEDULED"]}}}})
        # this schedule's run: prefect.yaml's nightly cron fires runs too, when the test spans 03:00 UTC
        fired = next((r for r in runs if r["auto_scheduled"]
                      and r.get("parameters", {}).get("overrides") == params["overrides"]), None)
        time.sleep(1)
    # one firing is enough: remove the test schedule (and the runs it queued for later)
    httpx.delete(f"{served.api}/deployments/{dep['id']}/schedules/{sched_id}", auth=(USER, PASSWORD), timeout=30,
                 trust_env=False)
    assert fired is not None, "the interval schedule did not fire within 120 s"
    done = wait(served.api, fired["id"], timeout=900, auth=AUTH)
    assert done["state"]["type"] == "COMPLETED", done["state"]
    from infra.registry import Registry

    reg = Registry(served.mlflow, "deltaloop-policy")
    newest = next(v for v in reg.versions()  # a run of this module's (under its run_root), not the cron's
                  if (served.run_root / v.tags.get("deltaloop.run_id", "-")).is_dir())
    assert newest.tags["base_model"] == "models:/deltaloop-policy/1"  # retrained from the pinned champion
    served.runs["retrain-version"] = {"version": newest.version}


def test_eval_gate_deployment_decides_with_artifacts(served: Served) -> None:
    version = served.runs.get("retrain-version", {}).get("version", "1")
    run = trigger(served.api, "eval-gate/eval-gate",
                  {"version": version, "config": "configs/demo.yaml", "overrides": served.overrides()}, auth=AUTH)
    done = wait(served.api, run["id"], timeout=600, auth=AUTH)
    assert done["state"]["type"] == "COMPLETED", done["state"]
    arts = served.post("artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}})
    md = next(a for a in arts if a["key"] == f"eval-gate-v{version}")
    assert "Eval gate: model version" in md["data"] and "**Reason:**" in md["data"]
    from infra.registry import Registry

    tags = Registry(served.mlflow, "deltaloop-policy").get(version).tags
    assert tags["deltaloop.gate_run"] and tags["deltaloop.status"] in ("promoted", "rejected")
    from mlflow.tracking import MlflowClient

    files = {a.path for a in MlflowClient(tracking_uri=served.mlflow).list_artifacts(tags["deltaloop.gate_run"], "gate")}
    assert {"gate/decision.json", "gate/decision.md"} <= files


def _browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium = next((p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser") if Path(p).exists()), None)
    driver = next((p for p in ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver") if Path(p).exists()), None)
    if not chromium or not driver:
        pytest.fail("headless UI test needs Debian's chromium and chromium-driver: run scripts/setup_ui_test.sh")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1000",
                 f"--user-data-dir={SHOTS.parent / '.chromium-profile'}-{os.getpid()}"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=driver), options=opts)


def _wait_text(drv: Any, needles: list[str], timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = drv.find_element("tag name", "body").text
        if all(n in text for n in needles):
            return text
        time.sleep(0.5)
    raise AssertionError(f"page {drv.current_url} never showed {needles}; it shows:\n{text[:3000]}")


def test_ui_headless_chromium_shows_deployments_run_and_champion(served: Served) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    run_name = served.runs["rl-train"]["name"]
    drv = _browser()
    try:
        # both UIs are behind the stack's auth: MLflow answers basic auth (sent on every request),
        # Prefect's UI sends what its login page stores
        drv.execute_cdp_cmd("Network.enable", {})
        drv.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": "Basic " + b64encode(
            AUTH.encode()).decode()}})
        drv.get(served.ui)
        drv.execute_script("localStorage.setItem('prefect-password', btoa(arguments[0]))", AUTH)
        drv.get(f"{served.ui}/deployments")
        _wait_text(drv, ["rl-train", "retrain", "eval-gate"])
        drv.save_screenshot(str(SHOTS / "prefect-deployments.png"))
        drv.get(f"{served.ui}/runs/flow-run/{served.runs['rl-train']['id']}")
        _wait_text(drv, [run_name, "Completed"])
        drv.save_screenshot(str(SHOTS / "prefect-rl-train-run.png"))
        drv.get(f"{served.ui}/runs")
        _wait_text(drv, [run_name])
        drv.save_screenshot(str(SHOTS / "prefect-runs.png"))
        drv.get(f"{served.mlflow}/#/models/deltaloop-policy")
        _wait_text(drv, ["deltaloop-policy", "@ champion"])  # the alias chip, not the description
        drv.save_screenshot(str(SHOTS / "mlflow-model-champion.png"))
    finally:
        drv.quit()
    for shot in ("prefect-deployments", "prefect-rl-train-run", "prefect-runs", "mlflow-model-champion"):
        assert (SHOTS / f"{shot}.png").stat().st_size > 5000
