"""Cross-section rules of ``weight_sync.placement`` (called by :class:`infra.config.RunConfig`'s validator).

``broadcast`` needs ``rollout.type: local``: vLLM applies versions inside its own model process,
which does not join the trainer's weight group.

``weight_sync.publish_ranks > 1`` (:mod:`infra.train.sharded_publish`) needs the object-store
placement, full weights (not LoRA), no more parts than trainer ranks, and a store every publishing
rank reaches (not a local folder when the ranks are on other hosts).

``colocated`` generates on the trainer ranks with the parameters they train
(:mod:`infra.rollout.colocated`), so it refuses what would need another engine, another copy of the
weights or generation overlapping training:

- ``rollout.type: vllm``: vLLM runs in its own environment and process, with its own weights;
- ``trainer.engine: fsdp`` and DeepSpeed ``zero_stage: 3``: each rank holds a shard of the
  parameters, and sampling would need them gathered every decode step;
- ``trainer.lora.enabled``: the rank's module is the adapter-wrapped model, which the sampler's
  fused forward does not read;
- ``loop.mode: async``: the batch for step t+1 is generated while step t trains, on the same ranks.
"""

from __future__ import annotations

from typing import Any


def colocated_problems(cfg: Any) -> list[str]:
    """What in ``cfg`` (a :class:`~infra.config.RunConfig`) ``weight_sync.placement: colocated``
    cannot run with, one line each naming the setting (empty for any other placement)."""
    if cfg.weight_sync.placement != "colocated":
        return []
    where = "weight_sync.placement=colocated generates on the trainer ranks with their own parameters"
    out = []
    if cfg.rollout.type != "local":
        out.append(f"rollout.type={cfg.rollout.type!r}: {where}, with the local engine only "
                   "(use placement object_store for vLLM)")
    t = cfg.trainer
    if t.engine == "fsdp" or (t.engine == "deepspeed" and t.zero_stage == 3):
        setting = "trainer.engine='fsdp'" if t.engine == "fsdp" else "trainer.zero_stage=3"
        out.append(f"{setting}: {where}, which needs every parameter whole on every rank "
                   "(use engine torch or deepspeed zero_stage 1/2)")
    if t.lora.enabled:
        out.append(f"trainer.lora.enabled=true: {where}; LoRA adapters are not supported there")
    if cfg.loop.mode == "async":
        out.append(f"loop.mode='async': {where}, so generation cannot overlap training (use loop.mode=sync)")
    return out


def broadcast_problems(cfg: Any) -> list[str]:
    """What in ``cfg`` ``weight_sync.placement: broadcast`` cannot run with (empty for any other placement)."""
    if cfg.weight_sync.placement != "broadcast" or cfg.rollout.type == "local":
        return []
    return [f"weight_sync.placement 'broadcast' needs rollout.type 'local' (got {cfg.rollout.type!r}): vLLM "
            "applies versions inside its own model process, which does not join the group; use "
            "weight_sync.placement 'object_store' with vLLM"]


def sharded_publish_problems(cfg: Any) -> list[str]:
    """What in ``cfg`` ``weight_sync.publish_ranks > 1`` cannot run with (empty when it is 1)."""
    ranks = cfg.weight_sync.publish_ranks
    if ranks == 1:
        return []
    where = f"weight_sync.publish_ranks={ranks} publishes each version from several trainer ranks"
    out = []
    if cfg.weight_sync.placement != "object_store":
        out.append(f"weight_sync.placement={cfg.weight_sync.placement!r}: {where}, into the object store only "
                   "(use placement object_store, or publish_ranks 1)")
    if ranks > cfg.cluster.ranks:
        out.append(f"cluster.ranks={cfg.cluster.ranks}: {where}, at most one part per trainer rank")
    if cfg.trainer.lora.enabled:
        out.append(f"trainer.lora.enabled=true: {where}; LoRA publishes its small adapters from rank 0 "
                   "(use publish_ranks 1)")
    if cfg.storage.type == "file" and cfg.cluster.type != "local":
        out.append(f"storage.type='file' with cluster.type={cfg.cluster.type!r}: {where}, each writing its shards "
                   "itself, so they need one store they all reach (use storage.type s3, or publish_ranks 1)")
    return out


def check_placement(cfg: Any) -> None:
    """Raise ``ValueError`` listing every problem of the placement (pydantic reports it as a config error)."""
    problems = broadcast_problems(cfg) + colocated_problems(cfg) + sharded_publish_problems(cfg)
    if problems:
        raise ValueError("; ".join(problems))
