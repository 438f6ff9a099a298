"""*evaluate*: the one held-out evaluator, and the one definition of a batch's score.

Every held-out score comes from :func:`evaluate_heldout`: greedy completions of the held-out split
(``env.eval_problems`` problems of ``env.seed``), each verified in the sandbox pool. Only the source
of the completions differs between callers — the rollout worker serving the run's current version
(:func:`evaluate`, before/after RL and every ``eval.every`` steps) or a model folder loaded in this
process (the eval gate, ``infra/stages/gate.py``). :func:`reward_stats` defines score, spread and
all-tests-pass accuracy, for evaluations and for the per-step training batch alike.

The report keeps per-problem rewards (not only the mean) so the promotion gate can compare a
candidate and the champion on the same problems. Reports are keyed by the weight version they
evaluate, so re-running an evaluation of the same version is free.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Callable

from infra.config import RunConfig
from infra.stages.context import Cluster, RunContext
from infra.storage import get_json, put_json

if TYPE_CHECKING:
    from evals.funcfit import Problem

# (held-out problems) -> (greedy completion text per problem, in order; generation seconds)
Generate = Callable[[list["Problem"]], tuple[list[str], float]]


def suite_name(cfg: RunConfig) -> str:
    """The held-out suite's name: environment, seed and size (reports are cached under it)."""
    return f"funcfit-heldout-{cfg.env.seed}-{cfg.env.eval_problems}"


def heldout_problems(cfg: RunConfig) -> list["Problem"]:
    """The held-out split the config names (deterministic in ``env.seed``)."""
    from evals.funcfit import eval_set

    return eval_set(cfg.env.seed, cfg.env.eval_problems, cfg.env.hidden_tests, cfg.env.families)


def reward_stats(rewards: list[float]) -> dict[str, float]:
    """``score`` (mean reward), ``std`` (population standard deviation) and ``accuracy`` (fraction of
    completions that pass every test) of a list of rewards in [0, 1]; 0 for an empty list."""
    n = max(1, len(rewards))
    mean = sum(rewards) / n
    return {"score": mean, "std": (sum((x - mean) ** 2 for x in rewards) / n) ** 0.5,
            "accuracy": sum(1 for x in rewards if x >= 1.0) / n}


def verify_completions(pool: Any, problems: list["Problem"], texts: list[str], timeout_s: float,
                       dedupe: bool = False) -> list[Any]:
    """Verify completion ``texts[i]`` of ``problems[i]`` in the sandbox pool; one result per text."""
    from evals.funcfit import to_verify_request

    return pool.verify_many([to_verify_request(p, t, timeout_s) for p, t in zip(problems, texts)], dedupe=dedupe)


def evaluate_heldout(cfg: RunConfig, generate: Generate, pool: Any) -> dict[str, Any]:
    """Greedy completions of the held-out split by ``generate``, verified in ``pool``: the report.

    The report has ``suite``, ``n``, ``score``, ``accuracy``, ``per_family`` (mean reward per
    function family), and per problem ``problem_ids``, ``rewards`` and ``completions``, plus
    ``generate_seconds``."""
    problems = heldout_problems(cfg)
    texts, seconds = generate(problems)
    rewards = [float(r.reward) for r in verify_completions(pool, problems, texts, cfg.sandbox.timeout_s)]
    stats = reward_stats(rewards)
    families: dict[str, list[float]] = {}
    for p, r in zip(problems, rewards):
        families.setdefault(p.family, []).append(r)
    return {
        "suite": suite_name(cfg), "n": len(rewards), "score": stats["score"], "accuracy": stats["accuracy"],
        "per_family": {f: sum(v) / len(v) for f, v in sorted(families.items())},
        "problem_ids": [p.id for p in problems], "rewards": rewards, "completions": texts,
        "generate_seconds": seconds,
    }


def _served_generate(ctx: RunContext, cluster: Cluster, version: int) -> Generate:
    """Greedy completions from the rollout worker (the version it serves now)."""

    def generate(problems: list["Problem"]) -> tuple[list[str], float]:
        prompts_key = ctx.key(None, "eval", "prompts.json")
        if not ctx.store.exists(prompts_key):
            put_json(ctx.store, prompts_key, {"prompts": [p.prompt for p in problems],
                                              "problems": [asdict(p) for p in problems]})
        gen_key = ctx.key(None, "eval", f"v{version:06d}-completions.json")
        gen = cluster.rollout.rollout(prompts_key, gen_key, 1, 0.0, ctx.cfg.eval.max_new_tokens, seed=0)
        texts = [""] * len(problems)
        for s in get_json(ctx.store, gen_key)["samples"]:
            texts[s["prompt_index"]] = s["text"]
        return texts, gen["seconds"]

    return generate


def evaluate(ctx: RunContext, cluster: Cluster, step: int) -> dict[str, Any]:
    """Evaluate the version the rollout worker serves now; returns the report (without per-problem lists)."""
    version = cluster.version
    out_key = ctx.key(None, "eval", f"v{version:06d}.json")
    if ctx.store.exists(out_key):
        report = get_json(ctx.store, out_key)
    else:
        report = {"version": version, "step": step,
                  **evaluate_heldout(ctx.cfg, _served_generate(ctx, cluster, version), cluster.sandbox)}
        put_json(ctx.store, out_key, report)
    ctx.report(f"eval at step {step} (v{version}): score {report['score']:.3f}, "
               f"all-tests-pass {report['accuracy']:.3f} on {report['n']} held-out problems")
    ctx.tracker.log_metrics({"eval_score": report["score"], "eval_accuracy": report["accuracy"]}, step=step)
    ctx.history.append({"kind": "eval", "step": step, "version": version, "score": report["score"],
                        "accuracy": report["accuracy"]})
    return {k: v for k, v in report.items() if k not in ("rewards", "completions", "problem_ids")} | {"key": out_key}


def generate_with_model(cfg: RunConfig, model: Any, tokenizer: Any) -> Generate:
    """Greedy completions from ``model`` in this process, on the configured rollout engine."""
    from infra.rollout import create_engine

    engine = create_engine(cfg.rollout, model.eval(), tokenizer)

    def generate(problems: list["Problem"]) -> tuple[list[str], float]:
        t0 = time.perf_counter()
        texts = engine.greedy([p.prompt for p in problems], cfg.eval.max_new_tokens)
        return texts, time.perf_counter() - t0

    return generate
