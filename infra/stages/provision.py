"""*provision*: start the long-lived services — trainer group, rollout worker, sandbox pool.

On a resumed run (``deltaloop run --resume``) the trainer restores the newest committed checkpoint
instead of warm-starting, and the rollout worker starts from the version published at provision;
the flow then replays the finished steps from the store, and trains the batches a crash left
generated but untrained as they are stored (:func:`~infra.stages.staleness.untrained_batches`). A
dead trainer group is replaced by :func:`restart_trainer`; a dead rollout worker is replaced by its
service on the next call (:meth:`~infra.rollout.service.RolloutService.restart`: the version it
served, the call sent again, at most ``rollout.max_restarts`` times), each replacement reported on
the run's progress lines.

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
    from infra.rollout.placement import create_rollout_service
    from infra.sandbox import create_pool
    from infra.train.service import TrainerService

    cfg = ctx.cfg
    t0 = time.perf_counter()
    init_dir = resolve_init(ctx)
    cluster = Cluster(trainer=None, rollout=None, sandbox=None)
    try:
        # launch both services first, then wait: their start-up (imports, model build) overlaps
        cluster.rollout = create_rollout_service(cfg, ctx.run_id, ctx.store, ctx.run_dir, init_dir, report=ctx.report)
        cluster.rollout.launch()
        cluster.trainer = TrainerService(cfg, ctx.run_id, ctx.store, ctx.run_dir, init_dir)
        cluster.trainer.start()
        cluster.sandbox = create_pool(cfg.sandbox)
        cluster.sandbox.start()
        cluster.rollout.wait_ready()
        ctx.report(f"rollout {cluster.rollout.where}; sandbox pool ({cfg.sandbox.runtime}) warm")
        info: dict[str, Any] = {"trainer": cluster.trainer.call("init")}
        health = cluster.trainer.health
        if health is not None:
            info["health"] = {"allreduce_latency_ms": health.allreduce_latency_ms,
                              "allreduce_bandwidth_gbps": health.allreduce_bandwidth_gbps,
                              "hosts": sorted({r.hostname for r in health.ranks})}
            ctx.report(f"health check passed: {health.world_size} rank(s) on {', '.join(info['health']['hosts'])}, "
                       f"all-reduce {health.allreduce_latency_ms:.2f} ms, {health.allreduce_bandwidth_gbps:.2f} GB/s")
        ctx.report(f"trainer up: {cfg.cluster.ranks} rank(s), {cfg.trainer.engine} engine, "
                   f"{info['trainer']['params']:,} parameters")
        cluster.rollout.bind_trainer(cluster.trainer)
        first_version, pub = start_trainer_state(ctx, cluster.trainer, info)
        load = cluster.rollout.load(first_version)
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


def start_trainer_state(ctx: RunContext, trainer: Any, info: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Resume the trainer from the newest checkpoint of this run, or warm-start, publish and save step 0.

    Returns the weight version the rollout worker must serve before step 1 and the publish record."""
    from infra.train.checkpoint import checkpoint_key, read_manifest

    cfg = ctx.cfg
    restored = trainer.call("restore")
    if restored["step"] is not None:
        info["restored"] = restored
        first = int(read_manifest(ctx.store, ctx.run_id, 0, key=checkpoint_key(ctx.run_dir))["weights_version"])
        ctx.report(f"resumed trainer from the checkpoint of step {restored['step']} "
                   f"(weights v{restored['weights_version']}); later steps replay from stored rollouts")
        _report_buffered(ctx)
        return first, {"version": first, "kind": "existing", "bytes_written": 0, "raw_bytes": 0, "seconds": 0.0}
    if ctx.cfg.init_from is None and cfg.warmstart.steps > 0:
        ctx.report(f"supervised warm start: {cfg.warmstart.steps} steps")
        from infra.ops.utilisation import phase
        from infra.stages.warmstart import store_warmstart_examples

        with phase(ctx.history, "warmstart"):  # trainer busy inside start-up (utilisation accounting)
            info["warmstart"] = trainer.call("warmstart", examples_key=store_warmstart_examples(ctx))
        ctx.report(f"warm start done in {info['warmstart'].get('seconds', 0):.1f}s "
                   f"(loss {info['warmstart'].get('final_loss', float('nan')):.3f})")
    pub = trainer.call("publish")
    info["checkpoint"] = trainer.call("checkpoint", step=0)
    return int(pub["version"]), pub


def _report_buffered(ctx: RunContext) -> None:
    """On resume: say which stored batches were generated and not trained before the crash (each is
    trained as it was generated, not generated again)."""
    from infra.stages.staleness import untrained_batches

    for b in untrained_batches(ctx):
        ctx.report(f"resume: the stored batch of step {b['step']} (generated by v{b['version']}, "
                   f"{'scored' if b['scored'] else 'not scored yet'}) is trained as it was generated")


def restart_trainer(ctx: RunContext, cluster: Cluster, reason: str) -> dict[str, Any]:
    """Replace a dead trainer group: fresh ranks, newest checkpoint restored. Returns ``{"step", ...}``.

    Raises :class:`~infra.train.service.TrainerRestartsExhausted` after ``trainer.max_restarts``."""
    from infra.train.service import TrainerRestartsExhausted, TrainerService

    done = int(cluster.info.get("trainer_restarts", 0))
    limit = ctx.cfg.trainer.max_restarts
    if done >= limit:
        raise TrainerRestartsExhausted(f"trainer died again after {done} restart(s) (max_restarts={limit}): {reason}")
    cluster.info["trainer_restarts"] = done + 1
    first_line = reason.strip().splitlines()[0] if reason.strip() else "no reason"
    ctx.report(f"trainer group died ({first_line}); restart {done + 1}/{limit} from the last checkpoint")
    old = cluster.trainer
    init_dir = getattr(old, "init_dir", None)
    if old is not None:
        old.close()
    cluster.trainer = TrainerService(ctx.cfg, ctx.run_id, ctx.store, ctx.run_dir, init_dir)
    cluster.trainer.start()
    cluster.trainer.call("init")
    cluster.rollout.bind_trainer(cluster.trainer)
    restored = cluster.trainer.call("restore")
    if restored["step"] is None:
        raise TrainerRestartsExhausted(f"run {ctx.run_id} has no committed trainer checkpoint to restart from")
    ctx.report(f"trainer restored at step {restored['step']} (weights v{restored['weights_version']})")
    return restored


def teardown(cluster: Cluster | None) -> list[str]:
    """Stop every service (idempotent); returns errors met while closing."""
    return cluster.close() if cluster is not None else []

