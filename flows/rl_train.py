"""The ``rl-train`` flow: provision → [rollout → score → train → sync]×N with evals → promote.

Each bracketed step is the loop train step → sync weights → rollout batch → score in sandboxes,
entered at the rollout: version 1 (the warm-started policy) is already served after provision, so
no rollout is wasted after the last update. Services are torn down in ``finally``, on success,
failure or cancellation. The run first queues for its cluster capacity (``trainer-slots`` and
``rollout-slots``, :mod:`flows.capacity`) and gives it back after teardown.

``resume`` re-enters the same loop: every stage returns its stored output, the trainer replays from
its checkpoint, and batches a crash left generated but untrained (async mode) are trained as they
were stored (:mod:`infra.stages.staleness`), so each step trains the prompts and samples an
uninterrupted run trains (``train.json`` of each step records them).
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow

from evals.registry import require_environments
from flows.capacity import hold_capacity
from flows.guard import check_deployment_request
from infra.config import load_config
from infra.ops.utilisation import phase, pool_window, timed
from infra.stages.context import prepare_run
from infra.stages.summary import build_summary, human_summary, record_step, write_summary
from tasks.evaluate import evaluate
from tasks.promote import promote
from tasks.provision import provision, teardown
from tasks.report import report_run
from tasks.rollout import rollout_batch
from tasks.score import score_batch
from tasks.staleness import check_staleness
from tasks.sync import sync_weights
from tasks.train import train_step


@flow(name="rl-train", log_prints=False)
def rl_train(config: str = "configs/demo.yaml", overrides: list[str] | None = None,
             resume: str | None = None) -> dict[str, Any]:
    """Run the whole RL pipeline for CONFIG (+ ``key=value`` overrides); returns the summary.

    ``resume``: the id of an earlier run to continue (finished stages are read back from the store).
    A run created from a deployment may only name project configs and allowed override keys
    (``flows/guard.py``); it is refused before anything starts."""
    check_deployment_request(config, overrides, resume)
    cfg = load_config(config, overrides or [])
    require_environments(cfg, config)
    with hold_capacity("train"):  # queues while the cluster is full; released after teardown
        return _run(cfg, resume)


def _run(cfg: Any, resume: str | None) -> dict[str, Any]:
    """The run itself, once its capacity is held."""
    ctx = prepare_run(cfg, resume)
    cluster = None
    status = "FAILED"
    try:
        cluster = timed(ctx.history, "provision", provision, ctx)
        before = timed(ctx.history, "eval", evaluate, ctx, cluster, 0, step=0)
        last_eval = before
        ahead = None  # async: (rollout, score) futures of the next step, running while this one trains
        for step in range(1, cfg.trainer.steps + 1):
            t0 = time.perf_counter()
            roll, score = (ahead[0].result(), ahead[1].result()) if ahead else _collect(ctx, cluster, step)
            roll, score, stale = check_staleness(ctx, cluster, step, roll, score)
            trained = train_step.submit(ctx, cluster, step)
            ahead = _collect_ahead(ctx, cluster, step + 1) if cfg.loop.mode == "async" and step < cfg.trainer.steps else None
            train = trained.result()
            if ahead:
                ahead[0].wait()  # the worker finishes the batch on the old version, then loads the new one
            sync = sync_weights(ctx, cluster, train["publish"]["version"])
            record_step(ctx, step, roll, score, train, sync, time.perf_counter() - t0, stale)
            if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.trainer.steps:
                last_eval = timed(ctx.history, "eval", evaluate, ctx, cluster, step, step=step)
        after = timed(ctx.history, "eval", evaluate, ctx, cluster, cfg.trainer.steps) if cfg.trainer.steps else last_eval
        gate = timed(ctx.history, "promote", promote, ctx, cluster, after["key"], cfg.trainer.steps) \
            if cfg.promote.enabled else None
        status = "FINISHED"
    finally:
        with phase(ctx.history, "teardown") as row:  # the pool's last window, for utilisation accounting
            try:
                row["sandbox_window"] = pool_window(cluster.sandbox if cluster else None)
            finally:
                teardown(cluster)
        ctx.tracker.end(status)
    summary = build_summary(ctx, before, after, gate)
    path = write_summary(ctx, summary)
    report_run(ctx, summary)
    ctx.report(human_summary(summary))
    return {**{k: v for k, v in summary.items() if k != "history"}, "summary_path": str(path)}


def _collect(ctx: Any, cluster: Any, step: int) -> tuple[dict, dict]:
    """Rollout then score, synchronously."""
    roll = rollout_batch(ctx, cluster, step)
    return roll, score_batch(ctx, cluster, step)


def _collect_ahead(ctx: Any, cluster: Any, step: int) -> tuple[Any, Any]:
    """Rollout then score as futures, running concurrently with the train step."""
    roll = rollout_batch.submit(ctx, cluster, step)
    return roll, score_batch.submit(ctx, cluster, step, wait_for=[roll])
