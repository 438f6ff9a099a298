"""*promote*: register the final policy (MLflow transformers flavour, :func:`infra.registry.save_mlflow_model`)
with its lineage and move ``champion`` only if the gate says so.

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
from pathlib import Path
from typing import Any

from evals.gate import GateDecision, check_suite_regressions, suite_rewards, veto_regressions
from infra.config import RunConfig
from infra.registry import Registry, save_mlflow_model
from infra.stages.context import Cluster, RunContext
from infra.stages.evaluate import run_suites, suite_report_key
from infra.stages.gate import gate_rewards, unscored_problems
from infra.storage import get_json


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


def gate_against_champion(cfg: RunConfig, reg: Registry, report: dict[str, Any]) -> tuple[GateDecision, str | None]:
    """The end-of-run decision on ``report`` (this run's final main-suite report, with ``suites``)
    against the current champion, read once: its alias, tags and logged final report. Returns the
    decision and the champion's version (None: no champion)."""
    pcfg = cfg.promote
    champ = reg.alias(pcfg.alias)
    if champ is None:
        return gate_rewards(report["problem_ids"], report["rewards"], None, pcfg,
                            unscored=unscored_problems(report), suites=report["suites"]), None
    rep = champion_report(reg, champ.run_id)
    rewards = ([float(x) for x in rep["rewards"]]
               if rep.get("suite") == report["suite"] and rep.get("problem_ids") == report["problem_ids"] else None)
    # a recorded mean is comparable only on the same suite (another task or size says nothing here)
    score = champ.score("eval_score") if champ.tags.get("eval_suite") in (None, report["suite"]) else None
    if rewards is None and score is None:
        return GateDecision(
            False, f"the champion (version {champ.version}) has no evaluation on suite {report['suite']} to compare "
            "with; `deltaloop gate VERSION` evaluates both on this run's suite",
            report["score"], None, confidence=pcfg.confidence, margin=pcfg.margin), champ.version
    decision = gate_rewards(report["problem_ids"], report["rewards"], rewards, pcfg, champion_score=score,
                            unscored=unscored_problems(report, rep if rewards is not None else None),
                            suites=report["suites"])
    if pcfg.no_regression and report["suites"]:
        decision = veto_regressions(decision, check_suite_regressions(
            suite_rewards(report["suites"]), suite_rewards(rep.get("suites") or {}), pcfg.confidence))
    return decision, champ.version


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
    with tempfile.TemporaryDirectory(dir=ctx.run_dir) as tmp:  # MLflow's transformers flavour, logged once
        card = f"# deltaloop policy\n\nrun {ctx.run_id}, step {step}"
        flavoured = save_mlflow_model(model_dir, Path(tmp) / "model", card)
        ctx.tracker.log_artifacts(flavoured, "model")
    reg = Registry(cfg.resolved_tracking_uri(), cfg.tracking.registered_model)
    decision, champ_version = gate_against_champion(cfg, reg, report)
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
