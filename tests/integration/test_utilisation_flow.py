"""The demo flow's utilisation and cost: every resource-second of a real run (torchrun ranks, rollout
worker, bubblewrap sandboxes, the flow process) in one bucket, priced, in summary.json and MLflow,
with the timeline picture; ``deltaloop report`` reads it back."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.flow_helpers import REPO, cli, run_env, run_flow

pytestmark = pytest.mark.slow


def test_demo_run_accounts_for_every_resource_second(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    proc = run_flow(root, "sync")
    summary_path = Path(proc.stdout.strip().splitlines()[-1])
    s = json.loads(summary_path.read_text())
    util, wall = s["utilisation"], s["wall_seconds"]
    assert set(util) == {"trainer", "rollout", "sandboxes", "orchestrator"}
    assert util["trainer"]["count"] == 2 and util["rollout"]["count"] == 1 and util["orchestrator"]["count"] == 1
    accounted = sum(r["busy_seconds"] + sum(r["idle_seconds"].values()) for r in util.values())
    expected = wall * sum(r["count"] for r in util.values())
    assert abs(accounted - expected) <= 0.02 * expected, (accounted, expected)
    for name, r in util.items():  # and per resource
        assert abs(r["busy_seconds"] + sum(r["idle_seconds"].values()) - wall * r["count"]) <= 0.02 * wall * r["count"]
    # measured work where the run did it: 4 train steps, 4 rollout batches, sandbox jobs, a warm start
    assert util["trainer"]["busy_by_kind"]["train"] > 0 and util["trainer"]["busy_by_kind"]["warmstart"] > 0
    assert util["rollout"]["busy_by_kind"]["generate"] > 0 and util["sandboxes"]["busy_seconds"] > 0
    assert util["trainer"]["idle_seconds"]["waiting_for_rollouts"] > 0
    assert util["rollout"]["idle_seconds"]["waiting_for_weights"] > 0
    assert util["sandboxes"]["idle_seconds"]["warm_no_job"] > 0
    assert util["trainer"]["idle_seconds"]["startup"] > 0 and util["trainer"]["idle_seconds"]["teardown"] > 0
    cost = s["cost"]
    assert s["cost_usd"] == pytest.approx(cost["total_usd"]) and s["cost_usd"] > 0
    assert s["cost_usd"] == pytest.approx(sum(c["usd"] for c in cost["by_resource"].values()))
    assert s["gain_per_dollar"] == pytest.approx((s["eval_after"] - s["eval_before"]) / s["cost_usd"])
    png = summary_path.parent / "timeline.png"
    assert png.read_bytes()[:4] == b"\x89PNG"

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=s["tracking_uri"])
    arts = {a.path for a in client.list_artifacts(s["mlflow_run_id"], "plots")}
    assert "plots/timeline.png" in arts
    assert "utilisation.json" in {a.path for a in client.list_artifacts(s["mlflow_run_id"])}
    report_md = Path(client.download_artifacts(s["mlflow_run_id"], "report.md", str(tmp_path))).read_text()
    assert "Utilisation and cost" in report_md and "waiting_for_weights" in report_md  # the Prefect artifact's text
    metrics = client.get_run(s["mlflow_run_id"]).data.metrics
    assert metrics["cost_usd"] == pytest.approx(s["cost_usd"])
    assert metrics["util_trainer_busy_s"] == pytest.approx(util["trainer"]["busy_seconds"])

    report = [cli(root, "sync")[0], "report", s["run_id"], "--set", f"run_root={root}"]
    out = subprocess.run(report, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| trainer | 2 |" in out.stdout and "per dollar" in out.stdout
    summary_path.rename(summary_path.with_suffix(".moved"))  # the run folder lost: read from MLflow
    again = subprocess.run([*report, "--json"], cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["utilisation"] == util
