"""Config sections of the trainer: GRPO optimisation, the distributed engine, LoRA, checkpoints."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from infra.configs.base import Strict


# ------------------------------------------------------------------------------------- trainer
class LoraConfig(Strict):
    """Low-rank adapters (peft) on the policy; only adapter weights train and are synced."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of the full model (needs peft).")
    rank: int = Field(8, ge=1, le=1024, description="Adapter rank r.")
    alpha: float = Field(16.0, gt=0, le=65536, description="Adapter scale numerator (scale = alpha / rank).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter input (0 keeps runs deterministic).")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1, max_length=64,
        description="Names of the linear layers that get adapters.",
    )


class TrainerConfig(Strict):
    """GRPO optimisation, the distributed engine, checkpointing (``infra/train/``; docs/training.md)."""

    engine: Literal["torch", "fsdp", "deepspeed"] = Field(
        "torch",
        description="torch: full replica per rank, one flat gradient all-reduce (DDP-style); fsdp: "
        "torch FullyShardedDataParallel; deepspeed: a ZeRO engine (zero_stage, offload_*).",
    )
    zero_stage: int = Field(
        1, ge=0, le=3,
        description="DeepSpeed ZeRO stage (engine=deepspeed): 1 shards optimizer state, 2 also gradients, "
        "3 also parameters. Ignored by the other engines.",
    )
    offload_optimizer: bool = Field(
        False, description="deepspeed: keep optimizer state and the update on the CPU (ZeRO-Offload).",
    )
    offload_params: bool = Field(False, description="deepspeed, zero_stage 3: keep parameters on the CPU (ZeRO-Infinity).")
    bf16: bool = Field(
        False,
        description="bfloat16 compute with fp32 master weights (deepspeed bf16, fsdp mixed precision, torch "
        "autocast). Off by default: CPU runs are fp32 and bit-reproducible.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute decoder-layer activations in backward (less memory, ~30% more compute).",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig)
    steps: int = Field(40, ge=1, le=1_000_000, description="RL steps (train+sync+rollout+score).")
    prompts_per_step: int = Field(16, ge=1, le=65536, description="Prompts per RL step.")
    group_size: int = Field(8, ge=2, le=1024, description="Samples per prompt (GRPO group G).")
    min_group_samples: int = Field(
        2, ge=1, le=1024,
        description="A group with masked samples (not scorable: sandbox infrastructure failures) trains only "
        "if at least this many of its samples were scored; otherwise it is dropped (masked_groups_dropped). "
        "Advantages are computed over the scored samples only. At most group_size.",
    )
    lr: float = Field(2e-4, gt=0, le=1.0, description="AdamW learning rate on fp32 master weights.")
    weight_decay: float = Field(0.0, ge=0, le=1.0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, le=1e6, description="Global gradient-norm clip.")
    clip_eps: float = Field(0.2, gt=0, le=10.0, description="PPO/GRPO ratio clip epsilon (lower side, and upper unless clip_eps_high is set).")
    clip_eps_high: float | None = Field(
        None, gt=0, le=10.0,
        description="Upper ratio clip (DAPO 'clip-higher', e.g. 0.28): lets unlikely tokens that earned reward "
        "grow faster, which keeps exploring longer. None = clip_eps (symmetric).",
    )
    advantage_norm: Literal["std", "none"] = Field(
        "std",
        description="std: (r - group mean) / group std (GRPO); none: r - group mean (Dr. GRPO: groups with one "
        "lucky success do not get a huge push).",
    )
    kl_coef: float = Field(0.0, ge=0, le=100.0, description="KL penalty to the frozen reference (0 = off).")
    inner_epochs: int = Field(1, ge=1, le=16, description="Optimizer passes over each rollout batch.")
    merge_duplicates: bool = Field(
        True,
        description="Train identical samples of one prompt (same tokens, hence same reward and rollout "
        "log-probs) as one row weighted by its count: the same gradient for less compute.",
    )
    micro_batch: int = Field(
        64, ge=1, le=65536,
        description="Sequences per forward/backward on a rank. Gradient accumulation: a rank's share of the "
        "batch runs as ceil(share / micro_batch) micro-batches whose gradients add up before one optimizer "
        "step per inner epoch, so micro_batch trades memory for speed without changing the update.",
    )
    checkpoint_every: int = Field(
        5, ge=1, le=1_000_000,
        description="Save the full trainer state (model, optimizer, RNG of every rank, step, weight version) "
        "to the object store every K steps (and after the warm start). Steps after the last checkpoint "
        "are replayed from their stored rollouts on resume.",
    )
    keep_checkpoints: int = Field(
        2, ge=1, le=1_000_000, description="Committed checkpoints kept (older ones are deleted; step 0 is kept)."
    )
    max_restarts: int = Field(
        3, ge=0, le=1000,
        description="Times a run restarts a dead trainer group (restore last checkpoint, replay) before failing.",
    )

    @model_validator(mode="after")
    def _engine_fields(self) -> "TrainerConfig":
        if self.engine != "deepspeed" and (self.offload_optimizer or self.offload_params):
            raise ValueError("trainer.offload_optimizer/offload_params need trainer.engine 'deepspeed'")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(f"trainer.offload_params needs trainer.zero_stage 3, got {self.zero_stage}")
        if self.lora.enabled and self.engine == "fsdp":
            raise ValueError("trainer.lora is supported with engine 'torch' or 'deepspeed', not 'fsdp'")
        if self.min_group_samples > self.group_size:
            raise ValueError(f"trainer.min_group_samples ({self.min_group_samples}) is larger than trainer.group_size "
                             f"({self.group_size}): every group with a masked sample would be dropped")
        return self
