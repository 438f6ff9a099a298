"""Eval gate, promote and rollback against a real MLflow registry (sqlite), with crafted eval results.

The evaluator is replaced by one that returns crafted per-problem rewards, so each case is exact:
a clearly better candidate is promoted, a worse one and a not-significantly-better one are
rejected, a candidate that collapses one family is vetoed by its guard, and ``deltaloop rollback``
restores the previous champion. Decisions must land as MLflow artifacts and version tags.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from infra.config import load_config
from infra.registry import PREVIOUS_TAG, Registry
from infra.stages.gate import run_eval_gate
from infra.tracking import Tracker

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("a*x+b", "x%a+b", "(x+a)*b")
IDS = [f"{f}|{i}|1" for f in FAMILIES for i in range(80)]


def _rewards(p: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [float(rng.random() < p) for _ in IDS]


class Crafted:
    """Evaluator returning fixed rewards per model version (and counting calls)."""

    def __init__(self) -> None:
        self.by_version: dict[str, list[float]] = {}
        self.calls: list[str] = []

    def __call__(self, version: str, work: str) -> dict[str, Any]:
        self.calls.append(version)
        r = self.by_version[version]
        return {"version": version, "suite": "crafted", "n": len(r), "score": sum(r) / len(r),
                "problem_ids": IDS, "rewards": r}


@pytest.fixture()
def setup(tmp_path: Path) -> tuple[Any, Registry, list[str]]:
    root = tmp_path / "runs"
    cfg = load_config(ROOT / "configs/demo.yaml", [f"run_root={root}", "promote.margin=0.0"])
    uri = cfg.resolved_tracking_uri()
    tracker = Tracker(uri, cfg.tracking.experiment, artifact_root=f"file://{root}/mlartifacts")
    reg = Registry(uri, cfg.tracking.registered_model)
    versions = []
    for i in range(5):
        tracker.start(f"train-{i}")
        folder = tmp_path / f"m{i}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"i": i}))
        tracker.log_artifacts(folder, "model")
        mv = reg.register(tracker.run_id or "", "model", {"step": i + 1, "config_hash": f"h{i + 1}", "deltaloop.run_id": f"r{i + 1}"})
        tracker.end()
        versions.append(mv.version)
    reg.point("champion", versions[0])
    return cfg, reg, versions


def test_gate_promotes_better_rejects_worse_and_not_significant(setup: tuple[Any, Registry, list[str]]) -> None:
    cfg, reg, (v1, v2, v3, v4, v5) = setup
    ev = Crafted()
    base = _rewards(0.4, 1)
    ev.by_version[v1] = base
    ev.by_version[v2] = [1.0 if (b or i % 4 == 0) else 0.0 for i, b in enumerate(base)]  # clearly better
    ev.by_version[v3] = [0.0 if (b and i % 3 == 0) else b for i, b in enumerate(base)]  # worse
    nudged = list(base)
    for i in [i for i, b in enumerate(base) if not b][:3]:  # +3/240: not significant
        nudged[i] = 1.0
    ev.by_version[v4] = nudged

    out = run_eval_gate(cfg, v2, evaluator=ev)
    assert out["promoted"] and out["champion_before"] == v1
    assert out["decision"]["method"] == "paired_bootstrap" and out["decision"]["ci_low"] > 0
    assert reg.alias("champion").version == v2  # type: ignore[union-attr]
    tags = reg.get(v2).tags
    assert tags["deltaloop.status"] == "promoted" and tags[PREVIOUS_TAG] == v1 and tags["promoted_by"] == "eval-gate"
    assert tags["config_hash"] == "h2" and tags["deltaloop.run_id"] == "r2"  # lineage kept
    files = {a.path for a in reg.client.list_artifacts(out["mlflow_run_id"], "gate")}
    assert {"gate/decision.json", "gate/decision.md", "gate/candidate_eval.json", "gate/champion_eval.json"} <= files
    assert "PROMOTED" in out["markdown"]

    ev.by_version[v3] = [0.0 if (b and i % 3 == 0) else b for i, b in enumerate(ev.by_version[v2])]
    worse = run_eval_gate(cfg, v3, evaluator=ev)
    assert not worse["promoted"] and worse["decision"]["improvement"] < 0
    assert reg.get(v3).tags["deltaloop.status"] == "rejected"

    ev.by_version[v4] = list(ev.by_version[v2])
    for i in [i for i, b in enumerate(ev.by_version[v2]) if not b][:3]:
        ev.by_version[v4][i] = 1.0
    ns = run_eval_gate(cfg, v4, evaluator=ev)
    assert not ns["promoted"] and 0 < ns["decision"]["improvement"] and ns["decision"]["ci_low"] <= 0
    assert "does not clear margin" in ns["decision"]["reason"]

    # better overall, but one family collapses: the guard vetoes it
    champ = ev.by_version[v2]
    ev.by_version[v5] = [0.0 if pid.startswith("x%a+b") else 1.0 for pid in IDS]
    guarded = run_eval_gate(cfg, v5, evaluator=ev)
    assert guarded["decision"]["improvement"] > 0 and not guarded["promoted"]
    assert "guard 'x%a+b' regressed" in guarded["decision"]["reason"]
    assert reg.alias("champion").version == v2  # type: ignore[union-attr]
    # the champion gated against itself is not re-evaluated
    again = run_eval_gate(cfg, v2, evaluator=ev)
    assert not again["promoted"] and "already the champion" in again["decision"]["reason"]
    assert champ == ev.by_version[v2]


def test_gate_vetoes_a_significant_regression_on_another_suite(setup: tuple[Any, Registry, list[str]]) -> None:
    cfg, reg, (v1, v2, v3, _, _) = setup
    cfg = load_config(ROOT / "configs/demo.yaml", [f"run_root={cfg.run_root}", "promote.no_regression=true",
                                                   "eval.suites=[{name: other, size: 200}]"])
    side = {v1: [1.0] * 200, v2: [0.0] * 150 + [1.0] * 50, v3: [1.0] * 199 + [0.0]}

    def ev(version: str, work: str) -> dict[str, Any]:
        main = {v1: _rewards(0.3, 1), v2: _rewards(0.9, 2), v3: _rewards(0.9, 2)}[version]
        other = {"suite": "other-x", "guard": True, "rewards": side[version]}
        return {"version": version, "suite": "crafted", "n": len(main), "score": sum(main) / len(main),
                "problem_ids": IDS, "rewards": main, "suites": {"other": other}}

    vetoed = run_eval_gate(cfg, v2, evaluator=ev)  # much better on the main suite, collapses on "other"
    assert vetoed["decision"]["improvement"] > 0.4 and not vetoed["promoted"]
    assert "suite 'other-x' regressed" in vetoed["decision"]["reason"]
    assert reg.alias("champion").version == v1  # type: ignore[union-attr]
    kept = run_eval_gate(cfg, v3, evaluator=ev)  # one problem worse on "other": not significant
    assert kept["promoted"] and "no regression on 1 suite" in kept["decision"]["reason"]


def test_end_of_run_gate_does_not_compare_a_champion_from_another_suite(
        setup: tuple[Any, Registry, list[str]]) -> None:
    from infra.stages.promote import gate_against_champion

    cfg, reg, (v1, _, _, _, _) = setup
    report = {"suite": "main-abc", "problem_ids": IDS, "rewards": _rewards(0.9, 5), "score": 0.9, "suites": {}}
    reg.set_tags(v1, {"eval_suite": "main-other", "eval_score": "0.1"})  # a lower score, on another task
    decision, champ = gate_against_champion(cfg, reg, report)
    assert champ == v1 and not decision.promote and "no evaluation on suite main-abc" in decision.reason
    reg.set_tags(v1, {"eval_suite": "main-abc"})  # same suite, recorded mean only: compared by means
    decision, _ = gate_against_champion(cfg, reg, report)
    assert decision.promote and decision.method == "mean"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltaloop.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_cli_promote_and_rollback_restore_previous_champion(setup: tuple[Any, Registry, list[str]]) -> None:
    cfg, reg, (v1, v2, v3, _, _) = setup
    root = f"run_root={cfg.run_root}"
    r = _cli("promote", v3, "--reason", "hotfix", "--set", root)
    assert r.returncode == 0, r.stderr
    assert f"{v1} -> {v3}" in r.stdout
    tags = reg.get(v3).tags
    assert tags["promoted_by"].startswith("human:") and tags["deltaloop.reason"] == "hotfix"
    assert tags["config_hash"] == "h3"  # lineage tags are untouched by a promotion
    r = _cli("rollback", "--set", root)
    assert r.returncode == 0, r.stderr
    assert f"{v3} -> {v1}" in r.stdout
    assert reg.alias("champion").version == v1  # type: ignore[union-attr]
    assert reg.get(v3).tags["deltaloop.status"] == "rolled_back"
    r = _cli("rollback", "--set", root)  # v1 has no earlier champion
    assert r.returncode == 1 and "no previous" in r.stderr
    r = _cli("champion", "--set", root)
    assert r.returncode == 0 and f"version {v1}" in r.stdout
    # a version that is not registered: one clear line, no flow run, no traceback
    for cmd in (["gate", "999"], ["promote", "999"]):
        r = _cli(*cmd, "--set", root)
        assert r.returncode == 1 and "version=999" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert reg.alias("champion").version == v1  # type: ignore[union-attr]
