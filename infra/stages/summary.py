"""End of run: curves as a PNG, ``summary.json`` in the run folder, a human summary."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from infra.stages.context import RunContext


def plot_curves(history: list[dict[str, Any]], path: Path) -> Path:
    """Reward per step and eval score per evaluation, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h for h in history if h["kind"] == "step"]
    evals = [h for h in history if h["kind"] == "eval"]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    ax[0].plot([h["step"] for h in steps], [h["reward_mean"] for h in steps], marker=".", label="train reward")
    ax[0].set_xlabel("step"); ax[0].set_ylabel("mean reward"); ax[0].set_title("rollout reward"); ax[0].grid(alpha=0.3)
    ax[1].plot([h["step"] for h in evals], [h["score"] for h in evals], marker="o", label="score")
    ax[1].plot([h["step"] for h in evals], [h["accuracy"] for h in evals], marker="s", label="all tests pass")
    ax[1].set_xlabel("step"); ax[1].set_title("held-out eval"); ax[1].legend(); ax[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_summary(ctx: RunContext, fields: dict[str, Any]) -> Path:
    """Write ``summary.json`` (and the curves PNG), log both to MLflow, return the summary path."""
    summary = {
        "run_id": ctx.run_id,
        "run_dir": str(ctx.run_dir),
        "mlflow_run_id": ctx.tracker.run_id,
        "tracking_uri": ctx.cfg.resolved_tracking_uri(),
        "store": ctx.store.uri,
        "wall_seconds": time.time() - ctx.started,
        **fields,
        "history": ctx.history,
    }
    path = ctx.run_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2, default=str))
    png = plot_curves(ctx.history, ctx.run_dir / "curves.png")
    ctx.tracker.log_artifact(path)
    ctx.tracker.log_artifact(png, "plots")
    return path


def human_summary(s: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    lines = [
        f"run {s['run_id']} finished in {s['wall_seconds']:.0f}s ({s['steps']} steps)",
        f"  eval (held-out): {s['eval_before']:.3f} -> {s['eval_after']:.3f} "
        f"({s['eval_after'] - s['eval_before']:+.3f})",
        f"  final weight version: {s['final_weight_version']}; synced {s.get('sync_bytes_total', 0) / 1e6:.2f} MB "
        f"in deltas ({s.get('sync_fraction_mean', 0) * 100:.2f}% of full on average)",
        f"  model version {s['model_version']}: {'PROMOTED to champion' if s['promoted'] else 'not promoted'}"
        f" — {s.get('gate_reason', '')}",
        f"  MLflow run {s['mlflow_run_id']} at {s['tracking_uri']}",
    ]
    return "\n".join(lines)


def record_step(ctx: RunContext, step: int, roll: dict[str, Any], score: dict[str, Any], train: dict[str, Any],
                sync: dict[str, Any], wall: float, stale: dict[str, Any] | None = None) -> dict[str, Any]:
    """Log one step's metrics to MLflow, keep them in the history, print a progress line."""
    m = train.get("metrics", {})
    pub = train.get("publish", {})
    stage_seconds = (roll.get("seconds", 0.0) + score.get("score_seconds", 0.0) + m.get("train_seconds", 0.0)
                     + m.get("checkpoint_seconds", 0.0) + pub.get("seconds", 0.0) + sync.get("seconds", 0.0))
    row = {
        "kind": "step", "step": step, "version": pub.get("version"),
        "reward_mean": score.get("reward_mean", 0.0), "reward_std": score.get("reward_std", 0.0),
        "solved_fraction": score.get("solved_fraction", 0.0),
        "loss": m.get("loss"), "kl": m.get("kl"), "clip_frac": m.get("clip_frac"), "grad_norm": m.get("grad_norm"),
        "rollout_tokens_per_s": roll.get("tokens_per_s"), "train_tokens_per_s": m.get("train_tokens_per_s"),
        "rollout_seconds": roll.get("seconds"), "score_seconds": score.get("score_seconds"),
        "train_seconds": m.get("train_seconds"), "sandbox_latency_ms": score.get("sandbox_latency_ms"),
        "sync_bytes": pub.get("bytes_written"), "sync_raw_bytes": pub.get("raw_bytes"),
        "sync_fraction": (pub.get("bytes_written", 0) / pub["raw_bytes"]) if pub.get("raw_bytes") else None,
        "sync_changed_fraction": pub.get("changed_fraction"),
        "sync_publish_seconds": pub.get("seconds"), "sync_load_seconds": sync.get("seconds"),
        "step_seconds": wall,
        "staleness": (stale or {}).get("staleness", 0), "batch_dropped": int(bool((stale or {}).get("dropped"))),
        "orchestration_overhead_fraction": max(0.0, wall - stage_seconds) / wall if wall > 0 else None,
    }
    ctx.history.append(row)
    pool = {f"sandbox_{k}": v for k, v in (score.get("sandbox") or {}).items()}
    ctx.tracker.log_metrics({**{k: v for k, v in row.items() if k not in ("kind", "step")}, **pool}, step=step,
                            synchronous=False)
    ctx.report(
        f"step {step:>3}/{ctx.cfg.trainer.steps}  reward {row['reward_mean']:.3f}±{row['reward_std']:.3f}  "
        f"solved {row['solved_fraction']:.2f}  kl {row['kl'] or 0:.4f}  v{row['version']} "
        f"stale {row['staleness']}  sync {(row['sync_bytes'] or 0) / 1e3:.1f} kB ({(row['sync_fraction'] or 0) * 100:.2f}%)  {wall:.2f}s"
    )
    return row
