"""*promote*: register the final policy with its lineage and move ``champion`` only if the gate says so.

The candidate is always registered (so a rejected model can still be inspected and promoted by
hand); its ``deltaloop.status`` tag says ``promoted`` or ``rejected`` and ``deltaloop.reason`` why.
The gate compares per-problem rewards on the same held-out suite when the champion's eval report is
available (it is logged as ``eval/final.json`` on every run), else the recorded mean score of the
same suite; a champion evaluated on another suite (another task, size or decoding) is not compared
at all: the candidate is registered but not promoted, and ``deltaloop gate`` evaluates both; guard
suites (per-group slices) and the CI level come from ``promote`` (see ``infra/stages/gate.py``). With
``promote.no_regression`` every guard suite of ``eval.suites`` that the champion's run also evaluated
may not be significantly worse (:func:`evals.gate.check_suite_regressions`).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict
from typing import Any

from evals.gate import GateDecision, check_suite_regressions, suite_rewards, veto_regressions
from infra.registry import Registry
from infra.stages.context import Cluster, RunContext
from infra.stages.evaluate import run_suites, suite_report_key
from infra.stages.gate import gate_rewards
from infra.storage import get_json


def champion_rewards(reg: Registry, alias: str, suite: str, problem_ids: list[str]) -> tuple[list[float] | None, float | None, str | None]:
    """The champion's per-problem rewards on ``suite`` (if logged), its recorded score, its version."""
    champ = reg.alias(alias)
    if champ is None:
        return None, None, None
    rep = champion_report(reg, champ.run_id)
    rewards = None
    if rep.get("suite") == suite and rep.get("problem_ids") == problem_ids:
        rewards = [float(x) for x in rep["rewards"]]
    # a recorded mean is comparable only on the same suite (another task or size says nothing here)
    same_suite = champ.tags.get("eval_suite") in (None, suite)
    return rewards, champ.score("eval_score") if same_suite else None, champ.version


def champion_report(reg: Registry, run_id: str | None) -> dict[str, Any]:
    """The ``eval/final.json`` a run logged ({} when the run or the artifact is not there)."""
    if not run_id:
        return {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = reg.client.download_artifacts(run_id, "eval/final.json", tmp)
            with open(path) as fh:
                return dict(json.load(fh))
    except Exception:  # champion logged elsewhere or without a report: the gate falls back to its score tag
        return {}



def promote(ctx: RunContext, cluster: Cluster, final_eval_key: str, step: int, sandbox_image: str) -> dict[str, Any]:
    """Export, register and gate the final policy. Returns the decision and the version made."""
    cfg = ctx.cfg
    report = get_json(ctx.store, final_eval_key)
    version = int(report["version"])
    report["suites"] = {
        suite.name: {**get_json(ctx.store, suite_report_key(ctx, suite, version)), "guard": suite.guard}
        for suite in run_suites(cfg)[1:] if ctx.store.exists(suite_report_key(ctx, suite, version))}
    ctx.tracker.log_dict(report, "eval/final.json")
    model_dir = ctx.run_dir / "model"
    cluster.trainer.call("export", path=str(model_dir))
    ctx.tracker.log_artifacts(model_dir, "model")
    reg = Registry(cfg.resolved_tracking_uri(), cfg.tracking.registered_model)
    champ_rewards, champ_score, champ_version = champion_rewards(reg, cfg.promote.alias, report["suite"],
                                                                 report["problem_ids"])
    if champ_version is not None and champ_rewards is None and champ_score is None:
        decision = GateDecision(
            False, f"the champion (version {champ_version}) was evaluated on another suite than {report['suite']}: "
            "not comparable; `deltaloop gate VERSION` evaluates both on this run's suite",
            report["score"], None, confidence=cfg.promote.confidence, margin=cfg.promote.margin)
    else:
        decision = gate_rewards(report["problem_ids"], report["rewards"], champ_rewards, cfg.promote,
                                champion_score=champ_score)
    champ = reg.alias(cfg.promote.alias)
    if cfg.promote.no_regression and champ is not None and report["suites"]:
        champ_suites = champion_report(reg, champ.run_id).get("suites") or {}
        decision = veto_regressions(decision, check_suite_regressions(
            suite_rewards(report["suites"]), suite_rewards(champ_suites), cfg.promote.confidence))
    tags = {
        "deltaloop.run_id": ctx.run_id,
        "mlflow_run_id": ctx.tracker.run_id,
        "step": step,
        "weight_version": report["version"],
        "eval_score": f"{report['score']:.6f}",
        "eval_accuracy": f"{report['accuracy']:.6f}",
        "eval_suite": report["suite"],
        "sandbox_image": sandbox_image,
        "config_hash": cfg.config_hash(),
        "base_model": cfg.init_from or f"{cfg.model.type}:{cfg.model.path or 'tiny'}",
        "deltaloop.status": "promoted" if decision.promote else "rejected",
        "deltaloop.reason": decision.reason,
        "champion_at_gate": champ_version or "none",
    }
    mv = reg.register(ctx.tracker.run_id or "", "model", tags)
    if decision.promote:
        reg.point(cfg.promote.alias, mv.version)
    out = {"promoted": decision.promote, "model_version": mv.version, "champion_before": champ_version,
           "decision": asdict(decision)}
    ctx.tracker.log_dict(out, "eval/gate_decision.json")
    ctx.tracker.set_tags({"deltaloop.promoted": decision.promote, "deltaloop.model_version": mv.version})
    return out
