"""*provision*: start the long-lived services — trainer group, rollout worker, sandbox pool.

Order matters on a small host: the rollout worker and the sandbox pool start in the background
while the trainer ranks initialise and (unless starting from a registered model) run the
supervised warm start; then the trainer publishes version 1 and the worker loads it. If anything
fails, whatever was already started is torn down before the error propagates.
"""

from __future__ import annotations

import time
from typing import Any

from infra.stages.context import Cluster, RunContext


def resolve_init(ctx: RunContext) -> str | None:
    """Download the model named by ``init_from`` (alias or models:/ URI) into the run folder."""
    ref = ctx.cfg.init_from
    if not ref:
        return None
    from infra.registry import Registry

    reg = Registry(ctx.cfg.resolved_tracking_uri(), ctx.cfg.tracking.registered_model)
    if not ref.startswith("models:/") and not ref.isdigit() and reg.alias(ref) is None:
        raise LookupError(
            f"init_from={ref!r}: model {ctx.cfg.tracking.registered_model!r} has no alias {ref!r} "
            f"in {ctx.cfg.resolved_tracking_uri()} (run once without init_from to create a champion)"
        )
    dst = ctx.run_dir / "init_model"
    path = reg.download(ref, dst)
    ctx.report(f"starting from registered model {ref} ({path})")
    return str(path)


def provision(ctx: RunContext) -> Cluster:
    """Start every service and publish the initial policy version. Returns the :class:`Cluster`."""
    from infra.rollout.service import RolloutService
    from infra.sandbox import create_pool
    from infra.train.service import TrainerService

    cfg = ctx.cfg
    t0 = time.perf_counter()
    init_dir = resolve_init(ctx)
    cluster = Cluster(trainer=None, rollout=None, sandbox=None)
    try:
        # launch both services first, then wait: their start-up (imports, model build) overlaps
        cluster.rollout = RolloutService(cfg, ctx.run_id, ctx.store, ctx.run_dir, init_dir)
        cluster.rollout.launch()
        cluster.trainer = TrainerService(cfg, ctx.run_id, ctx.store, ctx.run_dir, init_dir)
        cluster.trainer.start()
        cluster.sandbox = create_pool(cfg.sandbox)
        cluster.sandbox.start()
        cluster.rollout.wait_ready()
        ctx.report(f"rollout worker at {cluster.rollout.url}; sandbox pool ({cfg.sandbox.runtime}) warm")
        info: dict[str, Any] = {"trainer": cluster.trainer.call("init")}
        ctx.report(f"trainer up: {cfg.cluster.ranks} rank(s), {info['trainer']['params']:,} parameters")
        if init_dir is None and cfg.warmstart.steps > 0:
            ctx.report(f"supervised warm start: {cfg.warmstart.steps} steps")
            info["warmstart"] = cluster.trainer.call("warmstart")
            ctx.report(f"warm start done in {info['warmstart'].get('seconds', 0):.1f}s "
                       f"(loss {info['warmstart'].get('final_loss', float('nan')):.3f})")
        pub = cluster.trainer.call("publish")
        load = cluster.rollout.load(pub["version"])
        cluster.version = int(load["version"])
        info["publish"] = pub
        info["seconds"] = time.perf_counter() - t0
        cluster.info = info
        ctx.tracker.log_metrics({"provision_seconds": info["seconds"],
                                 "warmstart_seconds": info.get("warmstart", {}).get("seconds", 0.0)}, step=0)
        return cluster
    except BaseException:
        cluster.close()
        raise


def teardown(cluster: Cluster | None) -> list[str]:
    """Stop every service (idempotent); returns errors met while closing."""
    return cluster.close() if cluster is not None else []

