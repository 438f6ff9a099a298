"""``deltaloop report RUN_ID``: the breakdown of a past run from its summary.json; one error line for
an unknown run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from infra.config import CostConfig
from infra.ops.cost import price_run, unit_rates
from infra.ops.utilisation import account, closure

REPO = Path(__file__).resolve().parents[2]
DELTALOOP = str(Path(sys.executable).parent / "deltaloop")


def _summary(run_id: str) -> dict:
    hist = [{"kind": "phase", "phase": "provision", "t0": 0.0, "t1": 10.0},
            {"kind": "step", "step": 1, "spans": {"rollout": [10.0, 14.0], "score": [14.0, 15.0],
                                                  "train": [15.0, 25.0], "sync": [25.0, 26.0]},
             "sandbox_window": {"busy_sandbox_seconds": 1.0, "idle_sandbox_seconds": 20.0}},
            {"kind": "phase", "phase": "teardown", "t0": 28.0, "t1": 29.0}]
    util = account(hist, 0.0, 30.0, ranks=2, concurrency=2, min_warm=1)
    cost = price_run(util, unit_rates(CostConfig(), 1.0, 0, 1.0), gain=0.25)
    return {"run_id": run_id, "wall_seconds": 30.0, "steps": 1, "eval_before": 0.1, "eval_after": 0.35,
            "utilisation": util, "utilisation_window": [0.0, 30.0], "utilisation_closure": closure(util, 30.0),
            "cost_usd": cost["total_usd"], "cost": cost, "gain_per_dollar": cost["gain_per_dollar"], "history": hist}


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([DELTALOOP, "report", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_report_prints_the_breakdown_of_a_past_run(tmp_path: Path) -> None:
    run = tmp_path / "demo-20260101-000000-abcdef"
    run.mkdir()
    summary = _summary(run.name)
    (run / "summary.json").write_text(json.dumps(summary))
    out = _report(run.name, "--set", f"run_root={tmp_path}")
    assert out.returncode == 0, out.stderr
    assert f"run `{run.name}`" in out.stdout
    assert "| trainer | 2 |" in out.stdout and "waiting_for_rollouts" in out.stdout
    assert f"${summary['cost_usd']:.4f}" in out.stdout and "per dollar" in out.stdout
    as_json = json.loads(_report(run.name, "--json", "--set", f"run_root={tmp_path}").stdout)
    assert as_json["utilisation"]["trainer"]["busy_seconds"] == 20.0  # 10 s of training on 2 ranks


def test_report_of_an_unknown_run_is_one_error_line(tmp_path: Path) -> None:
    out = _report("no-such-run", "--set", f"run_root={tmp_path}")
    assert out.returncode == 1
    assert out.stderr.startswith("error: no finished run 'no-such-run' under") and "Traceback" not in out.stderr
    assert not (tmp_path / "mlflow.db").exists()  # reading a report does not create a tracking store
    bad = _report("../etc", "--set", f"run_root={tmp_path}")
    assert bad.returncode == 1 and "is not a run id" in bad.stderr
