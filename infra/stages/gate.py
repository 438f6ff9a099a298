"""*eval gate*: a registered candidate against the champion on the same eval suites; promote or reject.

Used two ways:

- at the end of ``rl-train`` (:func:`gate_rewards`, called by ``infra/stages/promote.py``) on the
  per-problem rewards the run already has;
- by the ``eval-gate`` flow (:func:`run_eval_gate`) for any registered version: both models are
  downloaded from the registry and evaluated by the run's own held-out evaluator
  (:func:`infra.stages.evaluate.evaluate_heldout`: greedy decoding of the held-out split, verified
  in the sandbox pool) on the same suite, so the comparison is paired.

The main suite is the whole held-out split; the guard suites are its per-family slices (a family
may not drop by more than ``promote.guard_tolerance`` even when the overall score rises). Every
suite named in ``promote.floors`` must reach its absolute minimum, champion or not
(:func:`evals.gate.veto_floors`); ``main`` is the held-out split. Reports
of a version on a suite are cached in the object store: versions are immutable, so re-gating is
cheap. The decision, the numbers and the reason are logged as MLflow artifacts of a gate run and
as tags on the candidate version; moving the alias records the previous champion (rollback).
"""

from __future__ import annotations

import getpass
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from evals.gate import (GateDecision, check_floors, check_suite_regressions, decide_with_guards, slices_by_prefix,
                        suite_rewards, veto_floors, veto_regressions)
from infra.config import PromoteConfig, RunConfig
from infra.ops.links import run_link_markdown
from infra.ops.report import gate_report
from infra.registry import Registry
from infra.stages.context import RunContext, new_run_id, prepare_run
from infra.stages.evaluate import evaluate_heldout, evaluate_suite, generate_with_model, run_suites, suite_name
from infra.storage import get_json, put_json

Evaluator = Callable[[str, str], dict[str, Any]]  # (version, model_dir) -> report with problem_ids, rewards


def unscored_problems(*reports: dict[str, Any] | None) -> list[bool] | None:
    """Per problem, whether any of ``reports`` has no scored sample of it (every sample masked by an
    infrastructure failure); None when none has such a problem."""
    flags = [r.get("masked_problems") for r in reports if r and r.get("masked_problems")]
    if not flags or not any(any(f) for f in flags):
        return None
    return [any(col) for col in zip(*flags)]


def gate_rewards(problem_ids: list[str], candidate: list[float], champion: list[float] | None,
                 pcfg: PromoteConfig, champion_score: float | None = None,
                 unscored: list[bool] | None = None, suites: dict[str, dict[str, Any]] | None = None) -> GateDecision:
    """The gate on per-problem rewards of one suite: paired bootstrap on all, guards per family, then
    the floors of ``promote.floors`` (``main``: this suite's mean; other names: the candidate's report
    of that extra suite in ``suites``, ``{name: {"rewards": [...]}}``).

    ``unscored`` (:func:`unscored_problems`): problems either side could not score are left out of
    the comparison; their 0.0 in the reports is a missing value, not a wrong answer."""
    if unscored:
        keep = [i for i, gone in enumerate(unscored) if not gone]
        if not keep:
            return GateDecision(False, "no evaluation problem was scored (infrastructure failures on every sample)",
                                0.0, champion_score, confidence=pcfg.confidence, margin=pcfg.margin)
        problem_ids = [problem_ids[i] for i in keep]
        candidate = [candidate[i] for i in keep]
        champion = [champion[i] for i in keep] if champion is not None else None
    guards = champion is not None and pcfg.guard_tolerance < 1.0
    decision = decide_with_guards(
        candidate, champion, pcfg.margin,
        guards_candidate=slices_by_prefix(problem_ids, candidate) if guards else None,
        guards_champion=slices_by_prefix(problem_ids, champion) if guards and champion else None,
        tolerance=pcfg.guard_tolerance, champion_score=champion_score, confidence=pcfg.confidence,
    )
    if not pcfg.floors:
        return decision
    return veto_floors(decision, check_floors(floor_scores(decision.candidate_score, suites or {}), pcfg.floors))


def floor_scores(main_score: float, suites: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """The candidate's mean per suite, as ``promote.floors`` names them: ``main`` and each extra
    suite report's mean reward (None: a report without rewards)."""
    out: dict[str, float | None] = {"main": main_score}
    for name, rep in suites.items():
        rewards = [float(x) for x in rep.get("rewards") or []]
        out[name] = sum(rewards) / len(rewards) if rewards else None
    return out


def extra_suites_needed(cfg: RunConfig) -> set[str]:
    """Extra suites (``eval.suites``) the gate reads: the guard ones under ``promote.no_regression``
    and every one with a floor."""
    names = {s.name for s in run_suites(cfg)[1:] if s.guard} if cfg.promote.no_regression else set()
    return names | (set(cfg.promote.floors) - {"main"})


def evaluate_model_dir(cfg: RunConfig, model_dir: str | Path, pool: Any) -> dict[str, Any]:
    """The main-suite report (:func:`~infra.stages.evaluate.evaluate_heldout`) of a Hugging Face folder,
    with the report of every extra suite the gate reads (:func:`extra_suites_needed`) under ``suites``."""
    from infra.model import load_policy

    model, tokenizer = load_policy(cfg.model, folder=model_dir)
    generate = generate_with_model(cfg, model, tokenizer)
    report = evaluate_heldout(cfg, generate, pool)
    needed = extra_suites_needed(cfg)
    if needed:
        report["suites"] = {s.name: {**evaluate_suite(s, generate, pool), "guard": s.guard}
                            for s in run_suites(cfg)[1:] if s.name in needed}
    return report


def registry_evaluator(cfg: RunConfig, reg: Registry, pool: Any, ctx: RunContext) -> Evaluator:
    """Evaluate registered versions, caching each (version, suite) report in the object store."""

    def evaluate(version: str, work: str) -> dict[str, Any]:
        key = f"gate/{reg.name}/v{int(version):06d}/{suite_name(cfg)}.json"
        wanted = extra_suites_needed(cfg)
        if ctx.store.exists(key):
            cached = get_json(ctx.store, key)
            if wanted <= set(cached.get("suites") or {}):
                return cached
        folder = reg.download(version, Path(work) / f"v{version}")
        ctx.report(f"eval gate: evaluating model version {version} on {suite_name(cfg)}")
        report = {"version": version, **evaluate_model_dir(cfg, folder, pool)}
        put_json(ctx.store, key, report)
        return report

    return evaluate


def run_eval_gate(cfg: RunConfig, version: str | int, evaluator: Evaluator | None = None) -> dict[str, Any]:
    """Gate registered ``version`` against the current champion; move the alias if it passes.

    ``evaluator`` (version, scratch dir) -> report replaces the real evaluation (tests craft results).
    Returns ``promoted``, ``model_version``, ``champion_before``, ``decision``, ``markdown``,
    ``mlflow_run_id``.
    """
    version = str(version)
    pcfg = cfg.promote
    reg = Registry(cfg.resolved_tracking_uri(), cfg.tracking.registered_model)
    cand = reg.get(version)  # raises if the version does not exist
    champ = reg.alias(pcfg.alias)
    ctx = prepare_run(cfg, run_id=new_run_id(f"gate-v{version}"))
    ctx.tracker.set_tags({"deltaloop.kind": "eval-gate", "deltaloop.candidate": version,
                          "deltaloop.champion_at_gate": champ.version if champ else "none"})
    status = "FAILED"
    pool = None
    try:
        if evaluator is None:
            from infra.sandbox import create_pool

            pool = create_pool(cfg.sandbox)
            pool.start()
            evaluator = registry_evaluator(cfg, reg, pool, ctx)
        with tempfile.TemporaryDirectory() as work:
            out = _decide(cfg, reg, cand.version, champ.version if champ else None, evaluator, work, ctx)
        status = "FINISHED"
        return out
    finally:
        if pool is not None:
            pool.close()
        ctx.tracker.end(status)


def _decide(cfg: RunConfig, reg: Registry, cand: str, champ: str | None, evaluator: Evaluator, work: str,
            ctx: RunContext) -> dict[str, Any]:
    pcfg = cfg.promote
    if champ == cand:
        decision = GateDecision(False, f"version {cand} is already the {pcfg.alias}", 0.0, None,
                                confidence=pcfg.confidence, margin=pcfg.margin)
        cand_rep, champ_rep = None, None
    else:
        cand_rep = evaluator(cand, work)
        champ_rep = evaluator(champ, work) if champ else None
        if champ_rep is not None and champ_rep["problem_ids"] != cand_rep["problem_ids"]:
            raise ValueError(f"candidate and champion were evaluated on different problems "
                             f"({cand_rep.get('suite')} vs {champ_rep.get('suite')})")
        decision = gate_rewards(cand_rep["problem_ids"], cand_rep["rewards"],
                                champ_rep["rewards"] if champ_rep else None, pcfg,
                                unscored=unscored_problems(cand_rep, champ_rep), suites=cand_rep.get("suites"))
        if pcfg.no_regression and champ_rep is not None and cand_rep.get("suites"):
            decision = veto_regressions(decision, check_suite_regressions(
                suite_rewards(cand_rep["suites"]), suite_rewards(champ_rep.get("suites") or {}), pcfg.confidence))
    d = asdict(decision)
    link = run_link_markdown(ctx.tracker.tracking_uri, ctx.tracker.experiment_id, ctx.tracker.run_id)
    md = gate_report(d, cand, champ, link, suite=cand_rep.get("suite") if cand_rep else None)
    if decision.promote:
        reg.point(pcfg.alias, cand)
    status = "promoted" if decision.promote else "rejected"
    reg.set_tags(cand, {"deltaloop.status": status, "deltaloop.reason": decision.reason,
                        "deltaloop.gate_run": ctx.tracker.run_id or "", "champion_at_gate": champ or "none",
                        **({"promoted_by": "eval-gate"} if decision.promote else {})})
    out = {"promoted": decision.promote, "model_version": cand, "champion_before": champ, "decision": d,
           "suite": cand_rep.get("suite") if cand_rep else None, "mlflow_run_id": ctx.tracker.run_id}
    ctx.tracker.log_dict(out, "gate/decision.json")
    ctx.tracker.log_text(md, "gate/decision.md")
    for name, rep in (("candidate", cand_rep), ("champion", champ_rep)):
        if rep is not None:
            ctx.tracker.log_dict(rep, f"gate/{name}_eval.json")
    metrics = {"gate_candidate_score": decision.candidate_score, "gate_champion_score": decision.champion_score,
               "gate_improvement": decision.improvement, "gate_ci_low": decision.ci_low,
               "gate_ci_high": decision.ci_high, "gate_promoted": float(decision.promote)}
    ctx.tracker.log_metrics(metrics, step=0)
    ctx.tracker.set_tags({"deltaloop.promoted": decision.promote})
    ctx.report(f"eval gate: version {cand} {status.upper()} — {decision.reason}")
    return {**out, "markdown": md}


def manual_promote(cfg: RunConfig, version: str | int, reason: str = "") -> dict[str, Any]:
    """A human moves the alias to ``version`` (no gate); lineage tags stay, the action is tagged."""
    reg = Registry(cfg.resolved_tracking_uri(), cfg.tracking.registered_model)
    cand = reg.get(str(version))
    before = reg.alias(cfg.promote.alias)
    reg.point(cfg.promote.alias, cand.version)
    who = _user()
    reg.set_tags(cand.version, {"deltaloop.status": "promoted", "promoted_by": f"human:{who}",
                                "deltaloop.reason": reason or f"manual promotion by {who}"})
    return {"model_version": cand.version, "champion_before": before.version if before else None}


def manual_rollback(cfg: RunConfig) -> dict[str, Any]:
    """Re-point the alias to the champion before the current one."""
    reg = Registry(cfg.resolved_tracking_uri(), cfg.tracking.registered_model)
    frm, to = reg.rollback(cfg.promote.alias)
    reg.set_tags(to, {"deltaloop.status": "promoted", "promoted_by": f"rollback:{_user()}"})
    return {"from": frm, "to": to}


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry (containers): still record something
        return "unknown"
