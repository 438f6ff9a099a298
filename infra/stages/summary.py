"""End of run: the summary (one builder), ``summary.json`` and the curves PNG in the run folder, a
human summary; and the per-step record that feeds them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from infra.atomicio import write_json_atomic
from infra.ops.cost import price_run, run_rates
from infra.ops.plots import plot_curves
from infra.ops.utilisation import POOL_KEYS, account, closure
from infra.stages.context import RunContext


def build_summary(ctx: RunContext, before: dict[str, Any], after: dict[str, Any],
                  gate: dict[str, Any] | None) -> dict[str, Any]:
    """The run's summary — the one dict behind ``summary.json``, the run report and the terminal lines.

    ``before``/``after``: the evaluation reports at step 0 and at the end; ``gate``: the promotion
    result (None when promotion is disabled). Aggregates over the per-step history: sync bytes and
    fraction of a full snapshot, staleness, orchestration overhead, and the samples the sandbox
    infrastructure could not score (masked, left out of the loss), the groups dropped for it and the
    pool's retries. Utilisation (:mod:`infra.ops.utilisation`) and cost (:mod:`infra.ops.cost`)
    cover the window from the run's start to now, the same ``wall_seconds``."""
    end = time.time()
    steps = [h for h in ctx.history if h["kind"] == "step"]
    fracs = [h["sync_fraction"] for h in steps if h.get("sync_fraction") is not None]
    stale = [h.get("staleness", 0) for h in steps]
    overheads = [h["orchestration_overhead_fraction"] for h in steps if h.get("orchestration_overhead_fraction")]
    evals = _eval_summary(ctx, before, after)
    cfg = ctx.cfg
    util = account(ctx.history, ctx.started, end, cfg.cluster.ranks, cfg.sandbox.concurrency, cfg.sandbox.min_warm,
                   colocated=cfg.weight_sync.placement == "colocated")
    util["sandboxes"]["concurrency"] = cfg.sandbox.concurrency
    cost = price_run(util, run_rates(cfg), gain=evals["eval_after"] - evals["eval_before"])
    return {**evals,
        "run_id": ctx.run_id,
        "run_dir": str(ctx.run_dir),
        "mlflow_run_id": ctx.tracker.run_id,
        "tracking_uri": ctx.cfg.resolved_tracking_uri(),
        "store": ctx.store.uri,
        "wall_seconds": end - ctx.started,
        "steps": len(steps), "final_weight_version": after["version"],
        "promoted": bool(gate and gate["promoted"]), "model_version": gate["model_version"] if gate else None,
        "gate_reason": gate["decision"]["reason"] if gate else "promotion disabled",
        "sync_bytes_total": sum(h.get("sync_bytes") or 0 for h in steps),
        "sync_fraction_mean": sum(fracs) / len(fracs) if fracs else 0.0,
        "weight_placement": cfg.weight_sync.placement, "publish_ranks": cfg.weight_sync.publish_ranks,
        "loop_mode": ctx.cfg.loop.mode, "max_staleness_seen": max(stale, default=0),
        "staleness_bound": ctx.cfg.loop.max_staleness,
        "orchestration_overhead_fraction_mean": sum(overheads) / len(overheads) if overheads else 0.0,
        "masked_samples": sum(h.get("masked_samples") or 0 for h in steps),
        "masked_groups_dropped": sum(h.get("masked_groups_dropped") or 0 for h in steps),
        "sandbox_retries": sum(h.get("sandbox_retries") or 0 for h in steps),
        "rollout_worker_restarts": max((h.get("rollout_worker_restarts") or 0 for h in steps), default=0),
        "utilisation": util, "utilisation_window": [ctx.started, end],
        "utilisation_closure": closure(util, end - ctx.started),
        "cost_usd": cost["total_usd"], "cost": cost, "gain_per_dollar": cost.get("gain_per_dollar"),
        "history": ctx.history,
    }


def _eval_summary(ctx: RunContext, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Main-suite scores before/after with the paired-bootstrap 95% interval of the gain (of the score
    and of the accuracy), and the same for every extra suite under ``suites``."""
    from infra.stages.evaluate import paired_gain, pass_at_k_means
    from infra.storage import get_json

    def pair(b: dict[str, Any], a: dict[str, Any]) -> dict[str, Any]:
        full_b, full_a = (get_json(ctx.store, r["key"]) if "key" in r else r for r in (b, a))
        ci = paired_gain(full_b, full_a)
        ci_acc = paired_gain(full_b, full_a, metric="correct")
        return {"before": b["score"], "after": a["score"], "gain_ci95": list(ci) if ci else None,
                "accuracy_before": b["accuracy"], "accuracy_after": a["accuracy"],
                "accuracy_gain_ci95": list(ci_acc) if ci_acc else None, "n": a.get("n"),
                **({"pass_at_k_before": pass_at_k_means(b), "pass_at_k_after": pass_at_k_means(a)}
                   if "pass_at_k" in a else {})}

    main = pair(before, after)
    out: dict[str, Any] = {
        "eval_suite": after.get("suite"), "eval_n": main["n"],
        "eval_before": main["before"], "eval_after": main["after"], "eval_gain_ci95": main["gain_ci95"],
        "eval_accuracy_before": main["accuracy_before"], "eval_accuracy_after": main["accuracy_after"],
        "eval_accuracy_gain_ci95": main["accuracy_gain_ci95"],
        # samples the sandbox infrastructure could not score, left out of the means (not counted as wrong)
        "eval_masked_before": before.get("masked", 0), "eval_masked": after.get("masked", 0),
    }
    extra = {name: pair(before.get("suites", {})[name], rep) for name, rep in (after.get("suites") or {}).items()
             if name in (before.get("suites") or {})}
    if extra:
        out["suites"] = extra
    return out


def write_summary(ctx: RunContext, summary: dict[str, Any]) -> Path:
    """Write ``summary`` (from :func:`build_summary`) as ``summary.json`` and the curves PNG to the run
    folder, log both to MLflow, return the summary path."""
    path = ctx.run_dir / "summary.json"
    write_json_atomic(path, summary, indent=2, default=str)  # a crash mid-write keeps the previous one
    png = plot_curves(summary["history"], ctx.run_dir / "curves.png")
    ctx.tracker.log_artifact(path)
    ctx.tracker.log_artifact(png, "plots")
    if "utilisation" in summary:
        from infra.ops.timeline import plot_timeline
        from infra.ops.utilisation_report import utilisation_metrics, utilisation_record

        ctx.tracker.log_artifact(plot_timeline(summary, ctx.run_dir / "timeline.png"), "plots")
        ctx.tracker.log_dict(utilisation_record(summary), "utilisation.json")
        ctx.tracker.log_metrics(utilisation_metrics(summary), step=summary["steps"])
    return path


#: how the versions travelled, per ``weight_sync.placement`` (the object store's: as deltas)
_SYNCED_AS = {"broadcast": "as whole models over the broadcast group", "colocated": "(colocated: nothing moves)"}


def _published_by(ranks: int) -> str:
    return f", each published by {ranks} trainer ranks" if ranks > 1 else ""


def human_summary(s: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    lines = [
        f"run {s['run_id']} finished in {s['wall_seconds']:.0f}s ({s['steps']} steps)",
        f"  eval (held-out): {s['eval_before']:.3f} -> {s['eval_after']:.3f} "
        f"({s['eval_after'] - s['eval_before']:+.3f}, 95% CI {_ci(s.get('eval_gain_ci95'))}); accuracy "
        f"{s['eval_accuracy_before']:.3f} -> {s['eval_accuracy_after']:.3f} on {s.get('eval_n')} problems",
        f"  final weight version: {s['final_weight_version']}; synced {s.get('sync_bytes_total', 0) / 1e6:.2f} MB "
        f"{_SYNCED_AS.get(s.get('weight_placement', ''), 'in deltas')} "
        f"({s.get('sync_fraction_mean', 0) * 100:.2f}% of full on average"
        f"{_published_by(s.get('publish_ranks') or 1)})",
        f"  model version {s['model_version']}: {'PROMOTED to champion' if s['promoted'] else 'not promoted'}"
        f" — {s.get('gate_reason', '')}",
        f"  MLflow run {s['mlflow_run_id']} at {s['tracking_uri']}",
    ]
    if s.get("cost") is not None:
        gpd = s.get("gain_per_dollar")
        lines.insert(-1, f"  cost ${s['cost_usd']:.4f} (idle ${s['cost']['idle_usd']:.4f}); held-out gain per dollar "
                         f"{'n/a' if gpd is None else f'{gpd:+.2f}'}; `deltaloop report {s['run_id']}` for the breakdown")
    if s.get("masked_samples") or s.get("eval_masked"):
        lines.insert(-1, f"  not scorable (sandbox infrastructure): {s.get('masked_samples', 0)} training samples masked "
                         f"out of the loss ({s.get('masked_groups_dropped', 0)} groups dropped, "
                         f"{s.get('sandbox_retries', 0)} sandbox retries), {s.get('eval_masked', 0)} in the final eval")
    for name, suite in (s.get("suites") or {}).items():
        lines.insert(2, f"  suite {name}: {suite['before']:.3f} -> {suite['after']:.3f} "
                        f"(95% CI {_ci(suite.get('gain_ci95'))}) on {suite.get('n')} problems")
    return "\n".join(lines)


def _ci(ci: list[float] | None) -> str:
    return f"[{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "n/a"


def record_step(ctx: RunContext, step: int, roll: dict[str, Any], score: dict[str, Any], train: dict[str, Any],
                sync: dict[str, Any], wall: float, stale: dict[str, Any] | None = None) -> dict[str, Any]:
    """Log one step's metrics to MLflow, keep them in the history, print a progress line."""
    m = train.get("metrics", {})
    pub = train.get("publish", {})
    # bytes that synced the rollout engine: the published version's, or, when the version was
    # broadcast and is published to the store after (kind "behind"), the bytes on the wire
    sync_bytes = sync.get("bytes") if pub.get("kind") == "behind" else pub.get("bytes_written")
    stage_seconds = (roll.get("seconds", 0.0) + score.get("score_seconds", 0.0) + m.get("train_seconds", 0.0)
                     + m.get("checkpoint_seconds", 0.0) + pub.get("seconds", 0.0) + sync.get("seconds", 0.0))
    row = {
        "kind": "step", "step": step, "version": pub.get("version"),
        "reward_mean": score.get("reward_mean", 0.0), "reward_std": score.get("reward_std", 0.0),
        "solved_fraction": score.get("solved_fraction", 0.0),
        "loss": m.get("loss"), "kl": m.get("kl"), "clip_frac": m.get("clip_frac"), "grad_norm": m.get("grad_norm"),
        "rollout_tokens_per_s": roll.get("tokens_per_s"), "train_tokens_per_s": m.get("train_tokens_per_s"),
        "rollout_seconds": roll.get("seconds"), "score_seconds": score.get("score_seconds"),
        "score_ms_per_sample": score.get("score_ms_per_sample"),
        "train_seconds": m.get("train_seconds"), "sandbox_latency_ms": score.get("sandbox_latency_ms"),
        "sync_bytes": sync_bytes, "sync_raw_bytes": pub.get("raw_bytes"),
        "sync_fraction": ((sync_bytes or 0) / pub["raw_bytes"]) if pub.get("raw_bytes") else None,
        "sync_changed_fraction": pub.get("changed_fraction"),
        "sync_publish_seconds": pub.get("seconds"), "sync_load_seconds": sync.get("seconds"),
        "step_seconds": wall,
        "staleness": (stale or {}).get("staleness", 0), "batch_dropped": int(bool((stale or {}).get("dropped"))),
        # samples the sandbox infrastructure could not score (left out of the loss), and the pool's retries
        "masked_samples": score.get("masked_samples", 0), "infra_failure_rate": score.get("infra_failure_rate", 0.0),
        "sandbox_retries": score.get("sandbox_retries", 0),
        "masked_groups_dropped": m.get("masked_groups_dropped", 0), "loss_tokens": m.get("loss_tokens"),
        "rollout_worker_restarts": roll.get("worker_restarts", 0),  # dead rollout workers replaced so far
        "orchestration_overhead_fraction": max(0.0, wall - stage_seconds) / wall if wall > 0 else None,
        # wall-clock spans of the stages that ran and the pool's seconds (utilisation accounting)
        "spans": {name: [d["span"]["t0"], d["span"]["t1"]] for name, d in
                  (("rollout", roll), ("score", score), ("train", train), ("sync", sync)) if d.get("span")},
        "sandbox_window": {k: float(score["sandbox"].get(k, 0.0)) for k in POOL_KEYS} if score.get("sandbox") and not score.get("cached") else None,
    }
    ctx.history.append(row)
    pool = {f"sandbox_{k}": v for k, v in (score.get("sandbox") or {}).items()}
    ctx.tracker.log_metrics({**{k: v for k, v in row.items() if k not in ("kind", "step")}, **pool}, step=step,
                            synchronous=False)
    ctx.report(
        f"step {step:>3}/{ctx.cfg.trainer.steps}  reward {row['reward_mean']:.3f}±{row['reward_std']:.3f}  "
        f"solved {row['solved_fraction']:.2f}  kl {row['kl'] or 0:.4f}  v{row['version']} "
        f"stale {row['staleness']}  sync {(row['sync_bytes'] or 0) / 1e3:.1f} kB ({(row['sync_fraction'] or 0) * 100:.2f}%)  "
        f"masked {row['masked_samples']} ({row['infra_failure_rate'] * 100:.1f}%) retries {row['sandbox_retries']}  "
        f"{wall:.2f}s"
    )
    return row
