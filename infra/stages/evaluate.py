"""*evaluate*: the one evaluator of every suite, and the one definition of a batch's score.

A **suite** is an environment's split, a size and a decoding (:class:`Suite`). The **main** suite is
the run environment's held-out split (``env.eval_problems`` problems, greedy, ``eval.max_new_tokens``);
``eval.suites`` adds others (a second task, HumanEval with pass@k, the train split).
:func:`evaluate_suite` is the evaluator: the suite's items are rendered and completed by a
``generate`` function, then scored by the environment (:meth:`evals.env.Environment.score`: sandbox
for executed output, trusted comparisons otherwise). Only the source of the completions differs
between callers — the rollout worker serving the run's current version (:func:`evaluate`, before and
after RL and every ``eval.every`` steps on the main suite) or a model folder loaded in this process
(the eval gate, ``infra/stages/gate.py``). :func:`reward_stats` defines score, spread and accuracy,
for evaluations and for the per-step training batch alike.

A report keeps per-problem rewards and correctness (not only the means), so the promotion gate and
the run summary compare two versions on the same problems (paired bootstrap). Reports are keyed by
suite and weight version, so re-running an evaluation of the same version is free.

A sample the sandbox infrastructure could not score (:attr:`evals.env.Score.masked`) is not a wrong
answer: a problem's means are over its scored samples, a problem with none is left out of the suite's
means (``masked_problems``) and of paired comparisons, and the report counts them (``masked``, logged
as ``eval_masked``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from evals.env import Environment, Item
from evals.gate import paired_bootstrap
from evals.passk import pass_at_k_report
from evals.registry import cached_environment
from infra.config import EnvConfig, RunConfig
from infra.stages.context import Cluster, RunContext
from infra.storage import get_json, put_json

# (prompt batch artefact, samples per prompt, temperature, max new tokens)
#   -> (completion texts grouped by prompt, generation seconds)
Generate = Callable[[dict[str, Any], int, float, int], tuple[list[str], float]]


@dataclass(frozen=True)
class Suite:
    """One evaluation suite: ``size`` items of ``split`` of ``env``, decoded as stated."""

    name: str
    env: EnvConfig
    split: str = "heldout"
    size: int = 100
    max_new_tokens: int = 24
    temperature: float = 0.0
    samples: int = 1
    ks: tuple[int, ...] = (1,)
    guard: bool = True
    key: str = field(default="", compare=False)

    def cache_name(self) -> str:
        """Name of the suite's reports in the store: the name plus a hash of everything that defines it."""
        blob = (self.env.model_dump_json() + f"|{self.split}|{self.size}|{self.max_new_tokens}|{self.temperature}"
                f"|{self.samples}")
        return f"{self.name}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


def main_suite(cfg: RunConfig) -> Suite:
    """The run environment's held-out split, greedy: the suite every gain and gate decision is about."""
    return Suite("main", cfg.env, "heldout", cfg.env.eval_problems, cfg.eval.max_new_tokens)


def run_suites(cfg: RunConfig) -> list[Suite]:
    """The main suite, then every ``eval.suites`` entry resolved against the run's defaults."""
    out = [main_suite(cfg)]
    for s in cfg.eval.suites:
        env = s.env if s.env is not None else cfg.env
        out.append(Suite(s.name, env, s.split, s.size or env.eval_problems, s.max_new_tokens or cfg.eval.max_new_tokens,
                         s.temperature, s.samples, tuple(s.k), s.guard))
    return out


def suite_name(cfg: RunConfig) -> str:
    """The main suite's cache name (gate reports are stored under it)."""
    return main_suite(cfg).cache_name()


def suite_items(suite: Suite, env: Environment) -> list[Item]:
    """The suite's items: the first ``size`` held-out items, or ``size`` train items of step 0."""
    return env.heldout_items(suite.size) if suite.split == "heldout" else env.train_items(0, suite.size)


def prompt_batch(env_cfg: EnvConfig, env: Environment, items: list[Item]) -> dict[str, Any]:
    """The artefact the rollout worker completes: prompts, the items, how to render and where to stop."""
    system = env_cfg.system_prompt if env_cfg.system_prompt is not None else env.system_prompt
    stop = list(env_cfg.stop) if env_cfg.stop is not None else list(env.stop)
    return {"prompts": [it.prompt for it in items], "items": [it.to_json() for it in items],
            "render": {"chat": env_cfg.chat, "system_prompt": system}, "stop": stop}


def reward_stats(rewards: list[float], correct: "list[bool] | list[float] | None" = None) -> dict[str, float]:
    """``score`` (mean reward), ``std`` (population standard deviation) and ``accuracy`` (mean of
    ``correct``: per sample a bool, per problem the fraction of its samples that are right; without
    it, the fraction of rewards equal to 1) of rewards in [0, 1]; 0 for an empty list."""
    n = max(1, len(rewards))
    mean = sum(rewards) / n
    ok = correct if correct is not None else [x >= 1.0 for x in rewards]
    return {"score": mean, "std": (sum((x - mean) ** 2 for x in rewards) / n) ** 0.5,
            "accuracy": sum(float(c) for c in ok) / n}


def evaluate_suite(suite: Suite, generate: Generate, pool: Any) -> dict[str, Any]:
    """Complete and score ``suite``; the report.

    ``score``/``accuracy`` are means over problems of the per-problem mean over samples;
    ``per_group`` the mean reward per item group; ``problem_ids``, ``rewards``, ``correct`` (per
    problem) and ``completions`` (the first sample each) for paired comparisons and reading;
    ``pass_at_k`` when the suite samples more than once; generation and scoring seconds."""
    env = cached_environment(suite.env)
    items = suite_items(suite, env)
    texts, gen_seconds = generate(prompt_batch(suite.env, env, items), suite.samples, suite.temperature,
                                  suite.max_new_tokens)
    t0 = time.perf_counter()
    scores = env.score([it for it in items for _ in range(suite.samples)], texts, pool)
    score_seconds = time.perf_counter() - t0
    m = suite.samples
    scored = [[s for s in scores[i * m:(i + 1) * m] if not s.masked] for i in range(len(items))]
    n_scored = [len(ss) for ss in scored]
    rewards = [sum(s.reward for s in ss) / max(1, len(ss)) for ss in scored]
    n_correct = [sum(1 for s in ss if s.correct) for ss in scored]
    correct = [c / max(1, n) for c, n in zip(n_correct, n_scored)]  # per problem: the share of its scored samples right
    masked_problems = [n == 0 for n in n_scored]
    live = [i for i in range(len(items)) if n_scored[i]]
    stats = reward_stats([rewards[i] for i in live], [correct[i] for i in live])
    groups: dict[str, list[float]] = {}
    for i in live:
        groups.setdefault(items[i].group or suite.env.type, []).append(rewards[i])
    reasons: dict[str, int] = {}
    for s in scores:
        reasons[s.reason] = reasons.get(s.reason, 0) + 1
    report = {
        "suite": suite.cache_name(), "suite_name": suite.name, "env": suite.env.type, "split": suite.split,
        "n": len(items), "samples": m, "score": stats["score"],
        "accuracy": stats["accuracy"],
        "per_group": {g: sum(v) / len(v) for g, v in sorted(groups.items())}, "reasons": reasons,
        "problem_ids": [it.id for it in items], "groups": [it.group for it in items], "rewards": rewards,
        "correct": correct, "completions": texts[::m],
        "masked": sum(1 for s in scores if s.masked), "masked_problems": masked_problems,
        "generate_seconds": gen_seconds, "score_seconds": score_seconds,
    }
    if m > 1:
        report["pass_at_k"] = _pass_at_k(items, n_correct, n_scored, list(suite.ks))
    return report


def _pass_at_k(items: list[Item], n_correct: list[int], n_scored: list[int], ks: list[int]) -> dict[str, Any]:
    """pass@k over the problems with at least ``max(ks)`` scored samples (each estimated from its
    scored ones; masked samples are neither right nor wrong). Empty when no problem has that many."""
    ok = [i for i, n in enumerate(n_scored) if n >= max(ks)]
    if not ok:
        return {"problems": 0, "k": []}
    return pass_at_k_report([items[i].id for i in ok], [n_correct[i] for i in ok], [n_scored[i] for i in ok], ks)


def evaluate_heldout(cfg: RunConfig, generate: Generate, pool: Any) -> dict[str, Any]:
    """The main suite's report (see :func:`evaluate_suite`)."""
    return evaluate_suite(main_suite(cfg), generate, pool)


def pass_at_k_means(report: dict[str, Any]) -> dict[int, float]:
    """``{k: pass@k}`` of a report (empty when the suite sampled once)."""
    pk = report.get("pass_at_k") or {}
    return {int(k): float(pk[f"pass@{k}"]) for k in pk.get("k", [])}


def paired_gain(before: dict[str, Any], after: dict[str, Any], metric: str = "rewards",
                confidence: float = 0.95) -> tuple[float, float] | None:
    """Paired-bootstrap interval of ``after - before`` on the same problems (None if they differ), over
    the problems scored in both (a problem whose samples were all masked in either is left out)."""
    if before.get("problem_ids") != after.get("problem_ids") or not after.get(metric):
        return None
    n = len(after[metric])
    gone = [a or b for a, b in zip(after.get("masked_problems") or [False] * n, before.get("masked_problems") or [False] * n)]
    diffs = [a - b for a, b, g in zip(after[metric], before[metric], gone) if not g]
    return paired_bootstrap(diffs, confidence=confidence) if diffs else None


def _served_generate(ctx: RunContext, cluster: Cluster, version: int, suite: Suite) -> Generate:
    """Completions from the rollout worker (the version it serves now)."""

    def generate(batch: dict[str, Any], n: int, temperature: float, max_new_tokens: int) -> tuple[list[str], float]:
        prompts_key = ctx.key(None, "eval", suite.cache_name(), "prompts.json")
        if not ctx.store.exists(prompts_key):
            put_json(ctx.store, prompts_key, batch)
        gen_key = ctx.key(None, "eval", suite.cache_name(), f"v{version:06d}-completions.json")
        gen = cluster.rollout.rollout(prompts_key, gen_key, n, temperature, max_new_tokens, seed=0)
        samples = sorted(get_json(ctx.store, gen_key)["samples"], key=lambda s: s["prompt_index"])
        return [s["text"] for s in samples], gen["seconds"]

    return generate


def suite_report_key(ctx: RunContext, suite: Suite, version: int) -> str:
    """Where the report of ``suite`` on weight ``version`` is stored."""
    return ctx.key(None, "eval", suite.cache_name(), f"v{version:06d}.json")


def evaluate(ctx: RunContext, cluster: Cluster, step: int, all_suites: bool = True) -> dict[str, Any]:
    """Evaluate the version the rollout worker serves now on the main suite (and, with
    ``all_suites``, every ``eval.suites`` entry); returns the main report without per-problem lists,
    plus ``key`` (the stored report) and ``suites`` (each extra suite's key and means)."""
    version = cluster.version
    out: dict[str, Any] = {}
    for suite in run_suites(ctx.cfg) if all_suites else [main_suite(ctx.cfg)]:
        key = suite_report_key(ctx, suite, version)
        if ctx.store.exists(key):
            report = get_json(ctx.store, key)
        else:
            report = {"version": version, "step": step,
                      **evaluate_suite(suite, _served_generate(ctx, cluster, version, suite), cluster.sandbox)}
            put_json(ctx.store, key, report)
        brief = {k: v for k, v in report.items() if k not in ("rewards", "completions", "problem_ids", "groups",
                                                               "correct", "masked_problems")} | {"key": key}
        prefix = "eval" if suite.name == "main" else f"eval_{suite.name}"
        ctx.tracker.log_metrics({f"{prefix}_score": report["score"], f"{prefix}_accuracy": report["accuracy"],
                                 f"{prefix}_masked": report.get("masked", 0),
                                 **{f"{prefix}_pass_at_{k}": v for k, v in pass_at_k_means(report).items()}},
                                step=step)
        masked = f" ({report['masked']} samples masked: not scorable)" if report.get("masked") else ""
        ctx.report(f"eval {suite.name} at step {step} (v{version}): score {report['score']:.3f}, "
                   f"accuracy {report['accuracy']:.3f} on {report['n']} problems{masked}")
        if suite.name == "main":
            out = brief
        else:
            out.setdefault("suites", {})[suite.name] = brief
    ctx.history.append({"kind": "eval", "step": step, "version": version, "score": out["score"],
                        "accuracy": out["accuracy"], "masked": out.get("masked", 0)})
    return out


def generate_with_model(cfg: RunConfig, model: Any, tokenizer: Any) -> Generate:
    """Completions from ``model`` in this process, on the configured rollout engine."""
    from infra.model import render_prompts
    from infra.rollout import create_engine
    from infra.rollout.engine import SamplingParams

    rollout = cfg.rollout
    if rollout.type == "vllm" and importlib.util.find_spec("vllm") is None:
        # vLLM lives in its own environment (the rollout worker's), not the flow's: sample here
        # with the local engine, same prompts and sampling settings
        rollout = rollout.model_copy(update={"type": "local"})
    engine = create_engine(rollout, model.eval(), tokenizer)

    def generate(batch: dict[str, Any], n: int, temperature: float, max_new_tokens: int) -> tuple[list[str], float]:
        t0 = time.perf_counter()
        ids = render_prompts(tokenizer, batch["prompts"], batch["render"]["chat"], batch["render"]["system_prompt"])
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, stop=batch["stop"],
                                top_p=1.0 if temperature == 0 else cfg.rollout.top_p)
        completions = sorted(engine.generate_ids(ids, n, params), key=lambda c: c.prompt_index)
        return [c.text for c in completions], time.perf_counter() - t0

    return generate
