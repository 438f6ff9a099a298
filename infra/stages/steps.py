"""The per-step stages: rollout batch, score in sandboxes, train step, sync weights.

Each stage reads its inputs from and writes its outputs to the object store under
``runs/<run>/step-<N>/``; if its output already exists (a retried task, a resumed run) it returns the
stored result instead of redoing the work.
"""

from __future__ import annotations

import time
from typing import Any

from evals.env import Item, check_unscored
from evals.registry import cached_environment
from infra.ops.utilisation import stage_span
from infra.stages.context import Cluster, RunContext
from infra.stages.evaluate import prompt_batch, reward_stats
from infra.storage import get_json, put_json


def rollout_batch(ctx: RunContext, cluster: Cluster, step: int) -> dict[str, Any]:
    """Draw fresh training items for ``step`` and sample ``group_size`` completions per prompt.

    A stored batch (``rollouts.json``, one object written whole) is returned as it is: a batch
    generated before a crash is trained after ``--resume``, not generated again. Scores without
    their rollouts (a crash between the two deletes of a dropped batch) are deleted before the batch
    is generated, so they can never pass for the new batch's. The seed is a function of (run seed,
    step) and sampling is seeded per row, so a batch generated again — after the flow or the rollout
    worker died mid-batch — has the samples the lost one would have had. A dead worker is replaced
    by the rollout service itself (:meth:`~infra.rollout.service.RolloutService.restart`);
    ``worker_restarts`` counts the run's replacements so far."""
    cfg = ctx.cfg
    out_key = ctx.key(step, "rollouts.json")
    prompts_key = ctx.key(step, "prompts.json")
    if ctx.store.exists(out_key):
        meta = get_json(ctx.store, out_key)
        return {"key": out_key, "version": meta["version"], "tokens": meta.get("tokens", 0),
                "seconds": meta.get("seconds", 0.0), "cached": True, "prompts_key": prompts_key,
                "worker_restarts": int(getattr(cluster.rollout, "restarts", 0))}
    t_start = time.time()  # wall-clock span of the stage, for utilisation accounting (``span``)
    ctx.store.delete(ctx.key(step, "scores.json"))
    env = cached_environment(cfg.env)
    items = env.train_items(step, cfg.trainer.prompts_per_step)
    put_json(ctx.store, prompts_key, prompt_batch(cfg.env, env, items))
    res = cluster.rollout.rollout(prompts_key, out_key, cfg.trainer.group_size, cfg.rollout.temperature,
                                  cfg.rollout.max_new_tokens, seed=cfg.seed * 1_000_003 + step)
    return {**res, "prompts_key": prompts_key, "worker_restarts": int(getattr(cluster.rollout, "restarts", 0)),
            "span": stage_span(t_start)}


def score_batch(ctx: RunContext, cluster: Cluster, step: int) -> dict[str, Any]:
    """Score every rollout with the environment (in the sandbox pool when it runs model output).

    Rewards are summarised by :func:`~infra.stages.evaluate.reward_stats`, the same definition of
    score and accuracy as the held-out evaluation, over the *scored* samples: a masked one (the
    sandbox infrastructure failed on every retry, :attr:`evals.env.Score.masked`) is stored in
    ``masked`` for the trainer to leave out, and counted (``masked_samples``, ``infra_failure_rate``,
    ``sandbox_retries``). Above ``loop.max_infra_failure_rate`` the stage raises the retryable
    :class:`~evals.env.UnscoredBatch` and stores nothing, so a retry scores the batch again."""
    out_key = ctx.key(step, "scores.json")
    if ctx.store.exists(out_key):
        return {**get_json(ctx.store, out_key)["summary"], "key": out_key, "cached": True}
    t_start = time.time()
    rollouts = get_json(ctx.store, ctx.key(step, "rollouts.json"))
    items = [Item.from_json(d) for d in get_json(ctx.store, ctx.key(step, "prompts.json"))["items"]]
    samples = rollouts["samples"]
    env = cached_environment(ctx.cfg.env)
    pool = cluster.sandbox if env.needs_sandbox else None
    t0 = time.perf_counter()
    results = env.score([items[s["prompt_index"]] for s in samples], [s["text"] for s in samples], pool)
    seconds = time.perf_counter() - t0
    # the pool's own window (queue wait, start/run latency, utilisation, idle sandbox-seconds, infra retries)
    sandbox = pool.metrics(reset=True) if pool is not None else None
    rate = check_unscored(results, ctx.cfg.loop.max_infra_failure_rate, f"step {step} scoring")
    masked = [bool(r.masked) for r in results]
    rewards = [float(r.reward) for r in results]
    reasons: dict[str, int] = {}
    for r in results:
        reasons[r.reason] = reasons.get(r.reason, 0) + 1
    scored = [r for r in results if not r.masked]
    stats = reward_stats([float(r.reward) for r in scored], [r.correct for r in scored])
    summary = {
        "reward_mean": stats["score"],
        "reward_std": stats["std"],
        "solved_fraction": stats["accuracy"],
        "score_seconds": seconds,
        "score_ms_per_sample": 1000 * seconds / max(1, len(results)),
        "reasons": reasons,
        "masked_samples": sum(masked),
        "infra_failure_rate": rate,
        "sandbox_retries": int((sandbox or {}).get("infra_retries", 0)),
    }
    if sandbox is not None:
        summary["sandbox"] = sandbox
        summary["sandbox_latency_ms"] = sandbox.get("run_p50_ms", 0.0)
    put_json(ctx.store, out_key, {"rewards": rewards, "reasons": [r.reason for r in results],
                                  "correct": [r.correct for r in results], "masked": masked, "summary": summary})
    return {**summary, "key": out_key, "span": stage_span(t_start)}


def _train_call(ctx: RunContext, cluster: Cluster, step: int) -> dict[str, Any]:
    return cluster.trainer.call(
        "train_step", step=step, rollouts_key=ctx.key(step, "rollouts.json"), scores_key=ctx.key(step, "scores.json"),
        prompts_key=ctx.key(step, "prompts.json"),
    )


def train_step(ctx: RunContext, cluster: Cluster, step: int) -> dict[str, Any]:
    """One GRPO update on the scored batch of ``step``; the trainer publishes the next version.

    The trainer's record of the step (``train.json``) names what it trained: the prompt ids of the
    batch, the weight version that generated it and a digest of its samples and scores
    (:func:`infra.train.worker.batch_record`), so runs can be compared step by step.

    If the trainer group dies (:class:`~infra.rpc.ServiceDied`: a rank was killed, a host lost), it
    is restarted from its newest checkpoint and the steps between that checkpoint and ``step`` are
    replayed from their stored rollouts and scores before ``step`` is trained — bit-identically on
    CPU. Gives up after ``trainer.max_restarts`` restarts.
    """
    from infra.rpc import ServiceDied
    from infra.stages.provision import restart_trainer

    replay: list[int] = []
    t_start = time.time()
    while True:
        try:
            while replay:
                _train_call(ctx, cluster, replay[0])
                replay.pop(0)
            return {**_train_call(ctx, cluster, step), "span": stage_span(t_start)}
        except ServiceDied as exc:
            if not exc.retryable:
                raise
            restored = restart_trainer(ctx, cluster, str(exc))
            replay = list(range(int(restored["step"]) + 1, step))
            if replay:
                ctx.report(f"replaying steps {replay[0]}..{replay[-1]} from stored rollouts")


def sync_weights(ctx: RunContext, cluster: Cluster, version: int) -> dict[str, Any]:
    """Make the rollout worker serve ``version`` (pulled from the store and applied in place).

    A worker that cannot apply it keeps serving the version it had. When an object of the version
    is corrupt or missing (not retryable), the trainer, which still holds these weights, writes the
    version again as a keyframe (``republish``) and the worker loads it once more; a store that did
    not answer raises :class:`~infra.rollout.errors.WeightsNotApplied` (retryable: the task retries)."""
    from infra.rollout.errors import RolloutError, WeightsNotApplied

    t_start = time.time()
    res = cluster.rollout.load(version)
    if int(res["version"]) != version and res.get("applied") is False and not res.get("retryable"):
        ctx.report(f"weight version {version} could not be applied ({res.get('error', 'no reason given')}); "
                   "the trainer writes it again as a keyframe")
        repaired = cluster.trainer.call("republish", version=version)
        res = {**cluster.rollout.load(version), "republished": repaired}
    if int(res["version"]) != version:  # it could not apply it and serves the version it had
        error = WeightsNotApplied if res.get("retryable") else RolloutError
        raise error(f"rollout worker still serves version {res['version']}, not {version}: "
                    f"{res.get('error', 'no reason given')}")
    cluster.version = version
    return {**res, "span": stage_span(t_start)}
