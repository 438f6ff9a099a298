"""*evaluate*: greedy completions on the held-out split, scored in the sandbox pool.

The report keeps per-problem rewards (not only the mean) so the promotion gate can compare a
candidate and the champion on the same problems. Reports are keyed by the weight version they
evaluate, so re-running an evaluation of the same version is free.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from infra.stages.context import Cluster, RunContext
from infra.storage import get_json, put_json


def evaluate(ctx: RunContext, cluster: Cluster, step: int) -> dict[str, Any]:
    """Evaluate the version the rollout worker serves now; returns the report (without per-problem lists)."""
    from evals.funcfit import eval_set, to_verify_request

    cfg = ctx.cfg
    version = cluster.version
    out_key = ctx.key(None, "eval", f"v{version:06d}.json")
    if ctx.store.exists(out_key):
        report = get_json(ctx.store, out_key)
    else:
        problems = eval_set(cfg.env.seed, cfg.env.eval_problems, cfg.env.hidden_tests, cfg.env.families)
        prompts_key = ctx.key(None, "eval", "prompts.json")
        if not ctx.store.exists(prompts_key):
            put_json(ctx.store, prompts_key, {"prompts": [p.prompt for p in problems],
                                              "problems": [asdict(p) for p in problems]})
        gen_key = ctx.key(None, "eval", f"v{version:06d}-completions.json")
        gen = cluster.rollout.rollout(prompts_key, gen_key, 1, 0.0, cfg.eval.max_new_tokens, seed=0)
        samples = get_json(ctx.store, gen_key)["samples"]
        results = cluster.sandbox.verify_many(
            [to_verify_request(problems[s["prompt_index"]], s["text"], cfg.sandbox.timeout_s) for s in samples]
        )
        rewards = [float(r.reward) for r in results]
        families: dict[str, list[float]] = {}
        for p, r in zip(problems, rewards):
            families.setdefault(p.family, []).append(r)
        report = {
            "version": version,
            "step": step,
            "suite": f"funcfit-heldout-{cfg.env.seed}-{len(problems)}",
            "score": sum(rewards) / max(1, len(rewards)),
            "accuracy": sum(1 for r in rewards if r >= 1.0) / max(1, len(rewards)),
            "n": len(rewards),
            "per_family": {f: sum(v) / len(v) for f, v in sorted(families.items())},
            "problem_ids": [p.id for p in problems],
            "rewards": rewards,
            "completions": [s["text"] for s in samples],
            "generate_seconds": gen["seconds"],
        }
        put_json(ctx.store, out_key, report)
    ctx.report(f"eval at step {step} (v{version}): score {report['score']:.3f}, "
               f"all-tests-pass {report['accuracy']:.3f} on {report['n']} held-out problems")
    ctx.tracker.log_metrics({"eval_score": report["score"], "eval_accuracy": report["accuracy"]}, step=step)
    ctx.history.append({"kind": "eval", "step": step, "version": version, "score": report["score"],
                        "accuracy": report["accuracy"]})
    return {k: v for k, v in report.items() if k not in ("rewards", "completions", "problem_ids")} | {"key": out_key}
